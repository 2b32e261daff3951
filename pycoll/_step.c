/* pycoll._step: a small direct collective's step, compiled.

   A prepared step of pycoll.algorithms.direct (one slot of the group segment,
   see transports/shm_group.py) takes the next step number and chain word,
   claims its slot, copies its input in, publishes the step, waits for the
   peers' words and reduces or copies their slots.  In Python that costs about
   1.1 us of an 8 B allreduce at n = 2 on the 2-core machine; as one C call,
   0.7 (docs/algorithms.md, "The compiled step and the compiled entry").
   Whatever has to wait or decide stays in Python and is called back: a claim
   that must wait for a slot, a wait that outlasts its spins (back-off,
   timeouts, liveness and mismatches), a reduction this file does not do.  The step only moves bytes
   and words at the addresses it was given, so a caller that gets an address
   wrong corrupts memory: pycoll.algorithms.direct is the only caller, with
   addresses of the segment it maps.  A step holds the GIL throughout but in
   its callbacks (its spins and yields are bounded), and a closed communicator
   drops its steps, so none runs on an unmapped segment.

   Step(...): one prepared step, whole; below, where it is defined.

   reduce(op, kind, out, count, rows) -> bool
       out = ((rows[0] OP rows[1]) OP rows[2]) ... elementwise, rows a tuple of
       addresses of count elements each, out a writable buffer of count
       elements that may be one of the rows.  op: 0 sum, 1 prod, 2 min, 3 max, 4 band, 5 bor,
       6 bxor; kind: the dtype, 'b' 'B' 'h' 'H' 'i' 'I' 'q' 'Q' (integers of
       1, 2, 4, 8 bytes, signed or not) or 'f' 'd' (float32, float64: sum and
       prod only, where IEEE arithmetic gives NumPy's bits).  Returns False,
       touching nothing, for any other op and kind: the caller reduces.  A
       Step reduces the same way; this function is its unit tests' handle.

   stream_copy(dst, src, nbytes)
       Copy nbytes from address src to address dst without the GIL, storing
       past the caches (x86's non-temporal stores; memmove elsewhere, and
       where the ranges overlap).  For copies far larger than the caches,
       whose destination is not read again soon: pycoll.buffers.copy_into
       decides when.

   copy(dst, src)
       dst's bytes = src's, two C-contiguous buffers of one length, in short
       pieces where dst starts 1-63 bytes after src modulo the page
       (transports/_copies.h says why); for the Python steps' copies between
       a caller's buffer and a slot.

   reduction_by_address(...), broadcast_by_address(...)
       pycoll.algorithms.direct's allreduce, reduce_scatter and broadcast by
       address, whole, without the GIL; below, where they are defined.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "../transports/_copies.h"

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#include <emmintrin.h>
#define STREAMING 1
#else
#define RELAX() ((void)0)
#endif

static long long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int
addr_of(PyObject *o, char **p)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *p = (char *)(uintptr_t)v;
    return 0;
}

#define LOOP(T, EXPR)                                                    \
    do {                                                                 \
        T *o = (T *)out;                                                 \
        const T *a = (const T *)rows[0];                                 \
        for (Py_ssize_t r = 1; r < nrows; r++) {                         \
            const T *b = (const T *)rows[r];                             \
            for (Py_ssize_t e = 0; e < count; e++) {                     \
                T u = a[e], v = b[e];                                    \
                o[e] = (T)(EXPR);                                        \
            }                                                            \
            a = o;                                                       \
        }                                                                \
    } while (0)

#define INT_OPS(T)                                                       \
    switch (op) {                                                        \
    case 0: LOOP(T, (uint64_t)u + (uint64_t)v); break;                   \
    case 1: LOOP(T, (uint64_t)u * (uint64_t)v); break;                   \
    case 2: LOOP(T, u < v ? u : v); break;                               \
    case 3: LOOP(T, u > v ? u : v); break;                               \
    case 4: LOOP(T, u & v); break;                                       \
    case 5: LOOP(T, u | v); break;                                       \
    case 6: LOOP(T, u ^ v); break;                                       \
    default: return 0;                                                   \
    }

#define FLOAT_OPS(T)                                                     \
    switch (op) {                                                        \
    case 0: LOOP(T, u + v); break;                                       \
    case 1: LOOP(T, u * v); break;                                       \
    default: return 0;                                                   \
    }

/* Integers of one width: min and max compare as the kind's sign says; every
   other op works on the unsigned type, sums and products in unsigned 64-bit
   arithmetic cut to the width, for the signed kinds too: they wrap as NumPy's
   do, without C's undefined signed overflow (or int promotion's: uint16 *
   uint16 overflows an int). */
#define INTS(S, U, SIGNED_KIND)                                          \
    do {                                                                 \
        if (kind == (SIGNED_KIND) && (op == 2 || op == 3)) {             \
            INT_OPS(S)                                                   \
        } else {                                                         \
            INT_OPS(U)                                                   \
        }                                                                \
        return 1;                                                        \
    } while (0)

static int
reduce_kind(int op, int kind, char *out, char **rows, Py_ssize_t nrows, Py_ssize_t count)
{
    switch (kind) {
    case 'b': case 'B': INTS(int8_t, uint8_t, 'b');
    case 'h': case 'H': INTS(int16_t, uint16_t, 'h');
    case 'i': case 'I': INTS(int32_t, uint32_t, 'i');
    case 'q': case 'Q': INTS(int64_t, uint64_t, 'q');
    case 'f':
        FLOAT_OPS(float)
        return 1;
    case 'd':
        FLOAT_OPS(double)
        return 1;
    default:
        return 0;
    }
}

static int
width(int kind)
{
    switch (kind) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': case 'f': return 4;
    case 'q': case 'Q': case 'd': return 8;
    default: return 0;
    }
}

static PyObject *
step_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "reduce takes 5 arguments");
        return NULL;
    }
    long op = PyLong_AsLong(args[0]);
    long kind = PyLong_AsLong(args[1]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *rowt = args[4];
    if (!PyTuple_Check(rowt)) {
        PyErr_SetString(PyExc_TypeError, "rows must be a tuple of addresses");
        return NULL;
    }
    int w = width((int)kind);
    Py_ssize_t nrows = PyTuple_GET_SIZE(rowt);
    if (!w || op < 0 || op > 6 || nrows < 2 || nrows > 64)
        Py_RETURN_FALSE;
    char *rows[64];
    for (Py_ssize_t r = 0; r < nrows; r++)
        if (addr_of(PyTuple_GET_ITEM(rowt, r), &rows[r]))
            return NULL;
    Py_buffer o;
    if (PyObject_GetBuffer(args[2], &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (o.len != count * w) {
        PyBuffer_Release(&o);
        PyErr_Format(PyExc_ValueError, "reduce: a %zd-byte output for %zd elements", o.len,
                     count);
        return NULL;
    }
    int ok = reduce_kind((int)op, (int)kind, (char *)o.buf, rows, nrows, count);
    PyBuffer_Release(&o);
    return PyBool_FromLong(ok);
}

/* Non-temporal stores write whole lines without reading them first and leave
   the caches to the source; the VM this was measured on copied 64 MiB at
   12.1 GB/s this way against 8.7 with memcpy (whose own switch to such stores
   comes from the cache size the CPU reports, 480 MiB there), and 8-32 MiB at
   0.91-0.93x memcpy's rate (benchmarks/RESULTS.md, "Streaming copies"). */
static void
copy_streaming(char *dst, const char *src, size_t n)
{
#ifdef STREAMING
    if (!(dst + n <= src || src + n <= dst)) {
        memmove(dst, src, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* the stores are weakly ordered: done before the caller posts */
    memcpy(dst + i, src + i, n - i);
#else
    memmove(dst, src, n);
#endif
}

static PyObject *
step_stream_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stream_copy takes 3 arguments");
        return NULL;
    }
    char *dst, *src;
    if (addr_of(args[0], &dst) || addr_of(args[1], &src))
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "stream_copy: a negative size");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_streaming(dst, src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}


/* copy(dst, src): dst's bytes = src's, both C-contiguous buffers of one
   length, by copy_bytes (transports/_copies.h: in short pieces where dst
   starts 1-63 bytes after src modulo the page); without the GIL from
   COPY_NOGIL bytes up. */
#define COPY_NOGIL (256 << 10)

static PyObject *
step_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src)");
        return NULL;
    }
    Py_buffer d, s;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &s, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "copy: %zd bytes into %zd", s.len, d.len);
    } else if (d.len >= COPY_NOGIL) {
        Py_BEGIN_ALLOW_THREADS
        copy_bytes(d.buf, s.buf, (size_t)d.len);
        Py_END_ALLOW_THREADS
    } else {
        copy_bytes(d.buf, s.buf, (size_t)d.len);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ Step

   Step(mode, group, claim, wait, reduce, K, kd, small, mul, mask, fpw, spins,
        nbytes, count, op, kind, slot, word, done, theirs, rows, dones, ahead,
        piece, yield_ns[, hole_at, hole, oblk])

   One prepared step of pycoll.algorithms.direct, whole: called as step(x, out)
   it does what that module's Python closure of the same mode does, in one C
   call while nothing has to wait.  Per call:

     s = group.seq + 1; c = (group.chain * mul + fpw) & mask (64-bit words:
     the chain lives in the bits of mask); both stored back on group;
     i = s % K (K: the group's posted words, W; the address tables below
     have K rows); w = c | s.
     Unless mode is LEAF, the slot (small: its part of it) and word of step s
     must be free: every peer's done word (at the addresses dones) at least
     need, which is s - kd (kd: the group's slots) for a step that fills its
     whole slot, which also stores group.last_big = s; for a small one,
     max(s - K, min(group.last_big, s - kd)) (as the group's claim, in
     transports/shm_group.py).  The step knows a bound below which they all
     are (from those loads, and from its waits: a peer seen at step s is done
     with step s - ahead); past it, it loads them, and where one is short,
     yields the CPU for up to yield_ns, then claim(s) waits (Python: it backs
     off).
     Then by mode:
       READ (allreduce, a reduce's root): copy x (nbytes) into slot[i], store
         done = s - 1 and word[i] = w (release), wait for theirs[i] to hold w,
         out = rows[i][0] OP rows[i][1] ... (count elements), done = s;
       WRITE (a reduce off its root, a gather off it, a scatter's root): copy in
         and post, done = s;
       GATHER (allgather, a gather's root, alltoall): copy in, post, wait,
         copy each nonzero rows[i][j] (oblk bytes, nbytes unless given) to
         block j of out, done = s.  A block of more than piece
         bytes goes in rounds of piece bytes (at most ahead of them), one step
         each, as direct's _slot_allgather: every round is copied in and
         posted (done = s - 1 with the first alone), then each is waited for,
         copied out and marked done;
       SCATTER (reduce_scatter): as READ, rows[i] being block r of each slot;
       ROOT (a broadcast's root): copy in, post, done = s;
       LEAF (a broadcast's leaves, a scatter's readers): wait for theirs[i],
         copy rows[i][0] (nbytes) into x, done = s.
     "Copy in" copies nbytes of x into the slot; where hole is given (one
     round, not a LEAF), x holds nbytes + hole bytes and its bytes [hole_at,
     hole_at + hole) stay out: the rank's own block of a scatter's root or of
     an alltoall, which the envelope copies.
     A wait spins at most spins rounds in all (the call's waits together),
     then yields the CPU (sched_yield) for at most yield_ns in all; a peer
     not there by then is waited for by wait(late, i, w) (Python: the
     group's wait, which backs off, times out, checks that the peer lives and
     raises on a mismatch), late being its index in theirs[i].  Both bounds
     keep the GIL's hold short: the step holds it while it yields.
     A reduction C does not do (op or kind outside those of reduce above) is
     reduce(i, out) (Python).

   Exceptions from claim, wait and reduce propagate; the step's state on the
   group is then what the Python closure would have left. */

enum { READ, WRITE, GATHER, SCATTER, ROOT, LEAF };
#define MAXK 64
#define MAXN 64
#define MAXR 8 /* rounds of a GATHER step */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int mode, K, kd, small, op, kind, m, nrows;
    PyObject *group, *claim, *wait, *reduce;
    uint64_t mul, mask, fpw, smask; /* smask: a posted word's step bits */
    long spins;
    long long yield_ns; /* past the spins, a wait yields the CPU this long before Python's */
    Py_ssize_t nbytes, count, piece; /* piece: the bytes of a round */
    Py_ssize_t hole_at, hole; /* x's bytes [hole_at, hole_at + hole) stay out of the slot */
    Py_ssize_t oblk;          /* GATHER: the bytes of a block of out, each rows[i][j]'s */
    int rounds;
    char *slot[MAXK], *word[MAXK], *done;
    char *dones[MAXN]; /* the peers' done words */
    int npeers;
    uint64_t ahead, floor; /* every peer is done with step floor (a bound that only grows) */
    char **theirs; /* K x m */
    char **rows;   /* K x nrows */
} Step;

static PyObject *s_seq, *s_chain, *s_last_big;

static void
step_dealloc(Step *self)
{
    Py_XDECREF(self->group);
    Py_XDECREF(self->claim);
    Py_XDECREF(self->wait);
    Py_XDECREF(self->reduce);
    PyMem_Free(self->theirs);
    PyMem_Free(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A tuple of K tuples of w addresses each, into out (K x w); -1 on error. */
static int
address_table(PyObject *t, int K, int *w, char ***out, const char *what)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != K) {
        PyErr_Format(PyExc_TypeError, "Step: %s must be a tuple of %d tuples", what, K);
        return -1;
    }
    Py_ssize_t width = -1;
    for (int i = 0; i < K; i++) {
        PyObject *row = PyTuple_GET_ITEM(t, i);
        if (!PyTuple_Check(row) || (width >= 0 && PyTuple_GET_SIZE(row) != width)) {
            PyErr_Format(PyExc_TypeError, "Step: %s must be tuples of one length", what);
            return -1;
        }
        width = PyTuple_GET_SIZE(row);
    }
    if (width > MAXN) {
        PyErr_Format(PyExc_ValueError, "Step: %s rows of more than %d", what, MAXN);
        return -1;
    }
    *w = (int)width;
    *out = PyMem_Calloc((size_t)K * (size_t)(width ? width : 1), sizeof(char *));
    if (*out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < K; i++)
        for (Py_ssize_t j = 0; j < width; j++)
            if (addr_of(PyTuple_GET_ITEM(PyTuple_GET_ITEM(t, i), j), &(*out)[i * width + j]))
                return -1;
    return 0;
}

static PyObject *step_vectorcall(PyObject *, PyObject *const *, size_t, PyObject *);

static PyObject *
step_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int mode, K, kd, small, op, kind;
    PyObject *group, *claim, *wait, *reduce, *slot, *word, *done, *theirs, *rows;
    unsigned long long mul, mask, fpw;
    long spins;
    Py_ssize_t nbytes, count;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Step takes no keyword arguments");
        return NULL;
    }
    PyObject *dones;
    unsigned long long ahead;
    Py_ssize_t piece, hole_at = 0, hole = 0, oblk = -1;
    long long yield_ns;
    if (!PyArg_ParseTuple(args, "iOOOOiipKKKlnniiOOOOOOKnL|nnn:Step", &mode, &group, &claim,
                          &wait, &reduce, &K, &kd, &small, &mul, &mask, &fpw, &spins, &nbytes,
                          &count, &op, &kind, &slot, &word, &done, &theirs, &rows, &dones, &ahead,
                          &piece, &yield_ns, &hole_at, &hole, &oblk))
        return NULL;
    if (oblk < 0)
        oblk = nbytes;
    if (!PyTuple_Check(dones) || PyTuple_GET_SIZE(dones) > MAXN) {
        PyErr_SetString(PyExc_TypeError, "Step: dones must be a tuple of the peers' addresses");
        return NULL;
    }
    if (mode < READ || mode > LEAF || K < 2 || K > MAXK || kd < 2 || kd > K || K % kd ||
        nbytes < 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "Step: bad mode, K, kd, nbytes or count");
        return NULL;
    }
    Py_ssize_t rounds = piece > 0 && nbytes > piece ? (nbytes + piece - 1) / piece : 1;
    if (piece <= 0 || rounds > MAXR || rounds > (Py_ssize_t)ahead || (rounds > 1 && mode != GATHER)) {
        PyErr_SetString(PyExc_ValueError,
                        "Step: piece must be positive, and split nbytes into rounds only for an "
                        "allgather, at most ahead and 8 of them");
        return NULL;
    }
    if (hole < 0 || hole_at < 0 || hole_at > nbytes || oblk == 0 ||
        ((hole || oblk != nbytes) && rounds > 1) || (hole && mode == LEAF)) {
        PyErr_SetString(PyExc_ValueError,
                        "Step: a hole inside nbytes, a positive oblk, and either only in one "
                        "round (a hole not for a LEAF)");
        return NULL;
    }
    if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != K || !PyTuple_Check(word) ||
        PyTuple_GET_SIZE(word) != K) {
        PyErr_SetString(PyExc_TypeError, "Step: slot and word must be tuples of K addresses");
        return NULL;
    }
    Step *self = (Step *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = step_vectorcall;
    self->mode = mode;
    self->K = K;
    self->kd = kd;
    self->small = small;
    self->op = op;
    self->kind = kind;
    self->mul = mul;
    self->mask = mask;
    self->smask = ~(uint64_t)mask;
    self->fpw = fpw;
    self->spins = spins;
    self->yield_ns = yield_ns;
    self->nbytes = nbytes;
    self->count = count;
    self->piece = piece;
    self->hole_at = hole_at;
    self->hole = hole;
    self->oblk = oblk;
    self->rounds = (int)rounds;
    self->ahead = ahead;
    self->floor = 0;
    self->npeers = (int)PyTuple_GET_SIZE(dones);
    for (int j = 0; j < self->npeers; j++)
        if (addr_of(PyTuple_GET_ITEM(dones, j), &self->dones[j])) {
            Py_DECREF(self);
            return NULL;
        }
    self->group = Py_NewRef(group);
    self->claim = Py_NewRef(claim);
    self->wait = Py_NewRef(wait);
    self->reduce = Py_NewRef(reduce);
    for (int i = 0; i < K; i++)
        if (addr_of(PyTuple_GET_ITEM(slot, i), &self->slot[i]) ||
            addr_of(PyTuple_GET_ITEM(word, i), &self->word[i]))
            goto fail;
    if (addr_of(done, &self->done) ||
        address_table(theirs, K, &self->m, &self->theirs, "theirs") ||
        address_table(rows, K, &self->nrows, &self->rows, "rows"))
        goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* The group's attribute name as a C integer; -1 and an exception on error. */
static int
get_u64(PyObject *o, PyObject *name, uint64_t *v)
{
    PyObject *a = PyObject_GetAttr(o, name);
    if (a == NULL)
        return -1;
    *v = PyLong_AsUnsignedLongLong(a);
    Py_DECREF(a);
    return (*v == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int
set_u64(PyObject *o, PyObject *name, uint64_t v)
{
    PyObject *a = PyLong_FromUnsignedLongLong(v);
    if (a == NULL)
        return -1;
    int rc = PyObject_SetAttr(o, name, a);
    Py_DECREF(a);
    return rc;
}

/* Python's wait(late, i, w) for the peers from index late of theirs[i]. */
static int
wait_slow(Step *self, Py_ssize_t late, int i, uint64_t w)
{
    PyObject *r = PyObject_CallFunction(self->wait, "niK", late, i, (unsigned long long)w);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* The least of the peers' done words. */
static uint64_t
step_least_done(Step *self)
{
    uint64_t least = UINT64_MAX;
    for (int j = 0; j < self->npeers; j++) {
        uint64_t d = __atomic_load_n((uint64_t *)self->dones[j], __ATOMIC_ACQUIRE);
        if (d < least)
            least = d;
    }
    return least;
}

/* Take the next step: s = group.seq + 1 and its chain, stored back on the
   group; unless a LEAF, wait until its slot is free (see Step above). */
static int
step_take(Step *self, uint64_t *sp)
{
    PyObject *group = self->group;
    uint64_t seq, chain;
    if (get_u64(group, s_seq, &seq) || get_u64(group, s_chain, &chain))
        return -1;
    uint64_t s = seq + 1;
    uint64_t c = (chain * self->mul + self->fpw) & self->mask;
    if (set_u64(group, s_seq, s) || set_u64(group, s_chain, c))
        return -1;
    *sp = c | s;
    if (self->mode == LEAF)
        return 0;
    uint64_t kd = (uint64_t)self->kd, W = (uint64_t)self->K;
    if (!self->small && set_u64(group, s_last_big, s))
        return -1;
    if (s <= kd || s - kd <= self->floor) /* need is at most s - kd */
        return 0;
    /* the slot (part) and word of the last step that used them: free once every
       peer is done with that step */
    uint64_t need = s - kd;
    if (self->small) {
        uint64_t big;
        if (get_u64(group, s_last_big, &big))
            return -1;
        need = big < need ? big : need;
        if (s > W && s - W > need)
            need = s - W;
        if (need <= self->floor)
            return 0;
    }
    uint64_t least = step_least_done(self);
    if (least < need && self->yield_ns > 0) {
        long long until = now_ns() + self->yield_ns;
        do {
            sched_yield();
            least = step_least_done(self);
        } while (least < need && now_ns() < until);
    }
    if (least < need) {
        PyObject *r = PyObject_CallFunction(self->claim, "K", (unsigned long long)s);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        least = need;
    }
    self->floor = least;
    return 0;
}

/* Wait until the peers' words of slot index i hold w: spin from the call's
   budget *spins, then yield the CPU until *until (set yield_ns ahead at the
   call's first yield), then let Python's wait (back-off, timeouts, liveness
   and mismatches) have the rest. */
static int
step_await(Step *self, int i, uint64_t w, long *spins, long long *until)
{
    char **theirs = self->theirs + (Py_ssize_t)i * self->m;
    for (int k = 0; k < self->m; k++) {
        while (__atomic_load_n((uint64_t *)theirs[k], __ATOMIC_ACQUIRE) != w) {
            if ((*spins)-- <= 0) {
                if (self->yield_ns > 0 && !*until)
                    *until = now_ns() + self->yield_ns;
                if (*until && now_ns() < *until) {
                    sched_yield();
                    continue;
                }
                if (wait_slow(self, k, i, w))
                    return -1;
                k = self->m; /* Python waited for the rest */
                break;
            }
            RELAX();
        }
    }
    uint64_t s = w & self->smask;
    if (self->m == self->npeers && s > self->ahead && s - self->ahead > self->floor)
        self->floor = s - self->ahead; /* a peer seen at step s consumed step s - ahead */
    return 0;
}

/* Round q's bytes of a block: [*at, *at + return value). */
static inline Py_ssize_t
round_span(const Step *self, int q, Py_ssize_t *at)
{
    *at = q * self->piece;
    Py_ssize_t left = self->nbytes - *at;
    return left < self->piece ? left : self->piece;
}

static PyObject *
step_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Step *self = (Step *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a Step takes (x, out)");
        return NULL;
    }
    int K = self->K, mode = self->mode;
    Py_ssize_t nbytes = self->nbytes, at, len;
    int rounds = self->rounds;
    uint64_t w[MAXR]; /* the rounds' posted words (step s: w & smask) */
    if (mode == LEAF) {
        if (step_take(self, &w[0]))
            return NULL;
    } else { /* copy in and post, round by round */
        Py_buffer x;
        if (PyObject_GetBuffer(args[0], &x, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (x.len != nbytes + self->hole) {
            PyErr_Format(PyExc_ValueError, "Step: %zd bytes for a %zd-byte step", x.len,
                         nbytes + self->hole);
            PyBuffer_Release(&x);
            return NULL;
        }
        for (int q = 0; q < rounds; q++) {
            if (step_take(self, &w[q])) {
                PyBuffer_Release(&x);
                return NULL;
            }
            uint64_t s = w[q] & self->smask;
            int i = (int)(s % (uint64_t)K);
            len = round_span(self, q, &at);
            if (self->hole) { /* one round: x but its hole */
                Py_ssize_t h = self->hole_at;
                copy_bytes(self->slot[i], (char *)x.buf, (size_t)h);
                copy_bytes(self->slot[i] + h, (char *)x.buf + h + self->hole, (size_t)(len - h));
            } else {
                copy_bytes(self->slot[i], (char *)x.buf + at, (size_t)len);
            }
            if (q == 0) /* every earlier step is read; a later round's post says nothing of it */
                __atomic_store_n((uint64_t *)self->done, s - 1, __ATOMIC_RELEASE);
            __atomic_store_n((uint64_t *)self->word[i], w[q], __ATOMIC_RELEASE);
        }
        PyBuffer_Release(&x);
    }
    uint64_t last = w[rounds - 1] & self->smask;
    if (mode == WRITE || mode == ROOT) {
        __atomic_store_n((uint64_t *)self->done, last, __ATOMIC_RELEASE);
        Py_RETURN_NONE;
    }
    PyObject *dst = mode == LEAF ? args[0] : args[1];
    Py_buffer o;
    if (PyObject_GetBuffer(dst, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    int gather = mode != READ && mode != SCATTER; /* GATHER, LEAF: blocks of nbytes */
    int w8 = width(self->kind), fast = gather || (w8 && o.len == self->count * w8);
    Py_ssize_t oblk = mode == GATHER ? self->oblk : nbytes;
    if (gather && o.len != self->nrows * oblk) {
        PyErr_Format(PyExc_ValueError, "Step: a %zd-byte output for %d blocks of %zd", o.len,
                     self->nrows, oblk);
        PyBuffer_Release(&o);
        return NULL;
    }
    long spins = self->spins;
    long long until = 0;
    for (int q = 0; q < rounds; q++) {
        uint64_t s = w[q] & self->smask;
        int i = (int)(s % (uint64_t)K);
        if (step_await(self, i, w[q], &spins, &until))
            goto fail;
        char **rows = self->rows + (Py_ssize_t)i * self->nrows;
        int ok = fast;
        if (gather) { /* round q of each block (one round where oblk is not nbytes) */
            len = oblk == nbytes ? round_span(self, q, &at) : (at = 0, oblk);
            for (int j = 0; j < self->nrows; j++)
                if (rows[j])
                    copy_bytes((char *)o.buf + j * oblk + at, rows[j], (size_t)len);
        } else if (fast) {
            ok = reduce_kind(self->op, self->kind, (char *)o.buf, rows, self->nrows, self->count);
        }
        if (!ok) {
            PyObject *r = PyObject_CallFunction(self->reduce, "iO", i, dst);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
        }
        __atomic_store_n((uint64_t *)self->done, s, __ATOMIC_RELEASE);
    }
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&o);
    return NULL;
}

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pycoll._step.Step",
    .tp_basicsize = sizeof(Step),
    .tp_dealloc = (destructor)step_dealloc,
    .tp_vectorcall_offset = offsetof(Step, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One prepared small direct step, whole (see _step.c).",
    .tp_new = step_new,
};

/* ------------------------------------------------------------------ by address

   reduction_by_address(layout, K, rank, x, out, lo, hi, kind, op, piece, s, w1, t,
                        w2, two, phase, k, spin_ns, yields, nap_ns, budget_ns)
       -> (code, phase, k, peer, value)

   pycoll.algorithms.direct's allreduce (two = 1) or reduce_scatter (two = 0)
   by address, whole, without the GIL: the same words and bytes as its Python
   steps, so ranks may mix the two.  layout: the group's ControlLayout
   (transports/shm_group.py), (mem, ctrl0, line, done_off, closed_off,
   ranges_off, pids): mem exports the group segment (held for the call: a
   close() on another thread leaves it mapped until the call returns); ctrl0
   and the offsets place each rank's control line in it; pids are the ranks'
   pids.  x is the flat input,
   [lo, hi) this rank's block in elements of kind (see reduce above; op and
   kind must be ones it reduces); out the flat output, as long as x for an
   allreduce (it may be x), the block's length for a reduce_scatter.  Steps s
   and t, with posted words w1 and w2, are taken by the caller (t, w2 unused
   with one step).  Phases, from `phase` (and peer index k within it, peers
   taken in the order rank + 1, rank + 2, ...):

     0 claim s: every peer's done >= s - K;  1 post x as range s % K, done =
     s - 1, word = w1;  2 wait for every peer's word w1;  3 reduce the block,
     reading each peer's x in pieces of `piece` bytes (process_vm_readv), in
     rank order into out;  with two steps: 4 claim t;  5 post out as range
     t % K, done = s, word = w2;  6 for each peer: wait for its word w2, write
     the block into its out (process_vm_writev);  then 7 done = the last step,
     wait until every peer's done reaches it.

   Each wait spins spin_ns, yields `yields` times, then naps (20 us doubling
   up to nap_ns).  The call returns rather than decide anything:
     (0, ...)                          done;
     (1, phase, k, peer, need)         peer's done is short of need after
                                       budget_ns, or a closed word is set: the
                                       caller waits (timeouts, liveness) and
                                       calls again from phase, k;
     (2, phase, k, peer, word)         the same for a posted word, returned at
                                       once where the peer's word is another
                                       one of this step or later (a mismatch);
     (3, phase, k, peer, errno)        a read (phase 3) or write (6) failed;
     (4, phase, k, peer, nbytes)       the peer's posted range has only nbytes.
   Phases 0-2 and 4-7 may be run again; after 3 or 6 fails, nothing is. */

#if defined(__linux__)

#define STEP_MASK ((UINT64_C(1) << 40) - 1)

typedef struct {
    long long spin_ns, nap_ns, budget_ns;
    long yields;
} Patience;

/* Until *w >= want (eq: == want): 0; else 1 once the budget is spent, a closed
   word is set or (eq) the word holds another word of this step or a later one. */
static int
await_word(const uint64_t *w, uint64_t want, int eq, const uint64_t *closed_peer,
           const uint64_t *closed_self, const Patience *pt)
{
    long long t0 = 0, nap = 20000;
    long yields = 0;
    for (;;) {
        uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (eq ? v == want : v >= want)
            return 0;
        if (eq && (v & STEP_MASK) >= (want & STEP_MASK))
            return 1;
        long long t = now_ns();
        if (!t0)
            t0 = t;
        else if (t - t0 < pt->spin_ns) {
            for (int i = 0; i < 32; i++)
                RELAX();
            continue;
        } else if (t - t0 >= pt->budget_ns || __atomic_load_n(closed_peer, __ATOMIC_ACQUIRE) ||
                   __atomic_load_n(closed_self, __ATOMIC_ACQUIRE))
            return 1;
        if (yields < pt->yields) {
            yields++;
            sched_yield();
        } else {
            struct timespec ts = {0, nap};
            nanosleep(&ts, NULL);
            if (nap < pt->nap_ns)
                nap = nap * 2 < pt->nap_ns ? nap * 2 : pt->nap_ns;
        }
    }
}

typedef struct {
    char *ctrl;
    Py_ssize_t line, done_off, closed_off, ranges_off;
    int K, rank, n;
    pid_t pids[MAXN];
} Layout;

#define WORD(L, j, i) ((uint64_t *)((L)->ctrl + (Py_ssize_t)(j) * (L)->line + 8 * (i)))
#define DONE(L, j) ((uint64_t *)((L)->ctrl + (Py_ssize_t)(j) * (L)->line + (L)->done_off))
#define CLOSED(L, j) ((uint64_t *)((L)->ctrl + (Py_ssize_t)(j) * (L)->line + (L)->closed_off))
#define RANGE(L, j, i) \
    ((uint64_t *)((L)->ctrl + (Py_ssize_t)(j) * (L)->line + (L)->ranges_off + 16 * (i)))

typedef struct {
    int code, phase, k, peer;
    uint64_t value;
} Outcome;

/* len bytes between local and offset off of rank q's posted range i (write:
   into the range); 0, or 1 with o's code, peer and value set (3: the copy
   failed, value its errno; 4: the range is short, value its length). */
static int
move_range(const Layout *L, int q, int i, uint64_t off, char *local, size_t len, int write,
           Outcome *o)
{
    const uint64_t *rg = RANGE(L, q, i);
    uint64_t addr = __atomic_load_n(&rg[0], __ATOMIC_RELAXED);
    uint64_t have = __atomic_load_n(&rg[1], __ATOMIC_RELAXED);
    int e = off + len > have ? -1 : len ? vm_move(L->pids[q], local, addr + off, len, write) : 0;
    if (!e)
        return 0;
    o->code = e < 0 ? 4 : 3, o->peer = q, o->value = e < 0 ? have : (uint64_t)e;
    return 1;
}

/* Wait for rank j's word *w to reach want (eq: equal it, a posted word; else
   at least, its done): 0, or 1 with o's code (2 for a posted word, 1 for a
   done), peer and value set, for the caller to return o. */
static int
await_peer(const Layout *L, int j, const uint64_t *w, uint64_t want, int eq, const Patience *pt,
           Outcome *o)
{
    if (!await_word(w, want, eq, CLOSED(L, j), CLOSED(L, L->rank), pt))
        return 0;
    o->code = eq ? 2 : 1, o->peer = j, o->value = want;
    return 1;
}

/* Wait until every peer's done reaches want, peers from index o->k on in the
   order rank + 1, rank + 2, ...: 0, or 1 as await_peer. */
static int
await_dones(const Layout *L, uint64_t want, const Patience *pt, Outcome *o)
{
    for (; o->k < L->n - 1; o->k++) {
        int j = (L->rank + 1 + o->k) % L->n;
        if (await_peer(L, j, DONE(L, j), want, 0, pt, o))
            return 1;
    }
    return 0;
}

/* Wait until every peer's posted word i holds w, peers from index o->k on in
   the order rank + 1, rank + 2, ...: 0, or 1 as await_peer. */
static int
await_posts(const Layout *L, int i, uint64_t w, const Patience *pt, Outcome *o)
{
    for (; o->k < L->n - 1; o->k++) {
        int j = (L->rank + 1 + o->k) % L->n;
        if (await_peer(L, j, WORD(L, j, i), w, 1, pt, o))
            return 1;
    }
    return 0;
}

/* Claim step st (every peer done with step st - K, the same slot): as await_dones. */
static int
claim_step(const Layout *L, uint64_t st, const Patience *pt, Outcome *o)
{
    return st > (uint64_t)L->K && await_dones(L, st - L->K, pt, o);
}

/* Post step st: [addr, addr + nbytes) as range st % K, done = st - 1, word w. */
static void
post_step(const Layout *L, uint64_t st, const char *addr, Py_ssize_t nbytes, uint64_t w)
{
    int r = L->rank, i = (int)(st % (uint64_t)L->K);
    uint64_t *rg = RANGE(L, r, i);
    rg[0] = (uint64_t)(uintptr_t)addr;
    rg[1] = (uint64_t)nbytes;
    __atomic_store_n(DONE(L, r), st - 1, __ATOMIC_RELEASE);
    __atomic_store_n(WORD(L, r, i), w, __ATOMIC_RELEASE);
}

/* The last phase of a call by address: done = st (once: at peer index 0), then
   wait until every peer's done reaches st, as await_dones. */
static int
finish_step(const Layout *L, uint64_t st, const Patience *pt, Outcome *o)
{
    if (o->k == 0)
        __atomic_store_n(DONE(L, L->rank), st, __ATOMIC_RELEASE);
    return await_dones(L, st, pt, o);
}

/* What an entry by address returns: (code, phase, k, peer, value). */
static PyObject *
outcome_tuple(Outcome o)
{
    return Py_BuildValue("iiiiK", o.code, o.phase, o.k, o.peer, (unsigned long long)o.value);
}

static Outcome
by_address(const Layout *L, char *x, char *out, char *dst, Py_ssize_t nbytes, Py_ssize_t lo,
           Py_ssize_t hi, int kind, int op, Py_ssize_t piece, uint64_t s, uint64_t w1,
           uint64_t t, uint64_t w2, int two, int phase, int k, const Patience *pt, char *tmp)
{
    Outcome o = {0, phase, k, -1, 0};
    int n = L->n, r = L->rank, K = L->K, wd = width(kind);
    uint64_t last = two ? t : s;
    for (; o.phase < 8; o.phase++, o.k = 0) {
        int ph = o.phase;
        if (!two && ph >= 4 && ph <= 6)
            continue; /* a reduce-scatter: one step */
        if (ph == 0 || ph == 4) { /* claim */
            if (claim_step(L, ph == 0 ? s : t, pt, &o))
                return o;
        } else if (ph == 1 || ph == 5) { /* post */
            post_step(L, ph == 1 ? s : t, ph == 1 ? x : out, nbytes, ph == 1 ? w1 : w2);
        } else if (ph == 2) { /* wait for the inputs */
            if (await_posts(L, (int)(s % (uint64_t)K), w1, pt, &o))
                return o;
        } else if (ph == 3) { /* reduce this rank's block, in rank order, piece by piece */
            int i = (int)(s % (uint64_t)K);
            Py_ssize_t per = piece / wd;
            char *own = tmp + piece; /* a copy of x's piece, in place */
            /* in place off rank 0, the first row lands on our operand before its turn */
            int overlap = r && dst < x + hi * wd && x + lo * wd < dst + (hi - lo) * wd;
            for (Py_ssize_t a = lo; a < hi; a += per) {
                Py_ssize_t b = a + per < hi ? a + per : hi, m = b - a;
                size_t len = (size_t)(m * wd);
                char *mine = x + a * wd, *acc = dst + (a - lo) * wd;
                if (overlap) {
                    copy_bytes(own, mine, len);
                    mine = own;
                }
                /* as the Python steps: acc = row 0 OP row 1, then acc = acc OP row q */
                char *first = mine;
                for (int q = 0; q < n; q++) {
                    char *row = mine;
                    if (q != r) {
                        row = q == 0 ? acc : tmp;
                        if (move_range(L, q, i, (uint64_t)(a * wd), row, len, 0, &o))
                            return o;
                    }
                    if (q == 0) {
                        first = row;
                        continue;
                    }
                    char *rows[2] = {q == 1 ? first : acc, row};
                    reduce_kind(op, kind, acc, rows, 2, m);
                }
            }
        } else if (ph == 6) { /* our block into every peer's output */
            int i = (int)(t % (uint64_t)K);
            size_t len = (size_t)((hi - lo) * wd);
            for (; o.k < n - 1; o.k++) {
                int j = (r + 1 + o.k) % n;
                if (await_peer(L, j, WORD(L, j, i), w2, 1, pt, &o))
                    return o;
                if (move_range(L, j, i, (uint64_t)(lo * wd), dst, len, 1, &o))
                    return o;
            }
        } else { /* 7: done, and every peer done with our buffers */
            if (finish_step(L, last, pt, &o))
                return o;
        }
    }
    o.phase = 8;
    return o;
}

/* L from layout, the group's ControlLayout (mem, ctrl0, line, done_off,
   closed_off, ranges_off, pids), and the entry's K and rank: the ranks and
   their pids; seg: the segment mem exports, L->ctrl its control lines from
   ctrl0.  0, or -1 with an exception set (seg then released). */
static int
open_layout(PyObject *layout, int K, int rank, Layout *L, Py_buffer *seg)
{
    PyObject *mem, *pids;
    Py_ssize_t ctrl0;
    if (!PyArg_ParseTuple(layout, "OnnnnnO:layout", &mem, &ctrl0, &L->line, &L->done_off,
                          &L->closed_off, &L->ranges_off, &pids))
        return -1;
    L->K = K, L->rank = rank;
    if (!PyTuple_Check(pids) || PyTuple_GET_SIZE(pids) < 2 || PyTuple_GET_SIZE(pids) > MAXN ||
        L->K < 2 || L->rank < 0 || L->rank >= PyTuple_GET_SIZE(pids)) {
        PyErr_SetString(PyExc_ValueError, "by address: bad pids, K or rank");
        return -1;
    }
    L->n = (int)PyTuple_GET_SIZE(pids);
    for (int j = 0; j < L->n; j++) {
        long v = PyLong_AsLong(PyTuple_GET_ITEM(pids, j));
        if (v == -1 && PyErr_Occurred())
            return -1;
        L->pids[j] = (pid_t)v;
    }
    if (PyObject_GetBuffer(mem, seg, PyBUF_WRITABLE) < 0)
        return -1;
    if (ctrl0 < 0 || ctrl0 + L->n * L->line > seg->len) {
        PyBuffer_Release(seg);
        PyErr_SetString(PyExc_ValueError, "by address: the control lines lie past the segment");
        return -1;
    }
    L->ctrl = (char *)seg->buf + ctrl0;
    return 0;
}

static PyObject *
step_reduction_by_address(PyObject *self, PyObject *args)
{
    PyObject *layout, *xo, *outo;
    Layout L;
    Py_ssize_t lo, hi, piece;
    unsigned long long s, w1, t, w2;
    int K, rank, kind, op, two, phase, k;
    Patience pt;
    if (!PyArg_ParseTuple(args, "OiiOOnniinKKKKiiiLlLL:reduction_by_address", &layout, &K,
                          &rank, &xo, &outo, &lo, &hi, &kind, &op, &piece, &s, &w1, &t, &w2, &two,
                          &phase, &k, &pt.spin_ns, &pt.yields, &pt.nap_ns, &pt.budget_ns))
        return NULL;
    int wd = width(kind);
    if (op < 0 || op > 6 || ((kind == 'f' || kind == 'd') && op > 1))
        wd = 0; /* an op reduce_kind does not do for this kind */
    if (!wd || piece < wd || phase < 0 || phase > 7 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "reduction_by_address: bad kind, op, piece or phase");
        return NULL;
    }
    Py_buffer seg, xb, ob;
    if (open_layout(layout, K, rank, &L, &seg) < 0)
        return NULL;
    if (PyObject_GetBuffer(xo, &xb, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&seg);
        return NULL;
    }
    if (PyObject_GetBuffer(outo, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&seg);
        return NULL;
    }
    Outcome o = {0, 0, 0, -1, 0};
    char *tmp = NULL;
    if (ob.len != (two ? xb.len : (hi - lo) * wd) || xb.len % wd || lo < 0 || hi < lo ||
        hi * wd > xb.len) {
        PyErr_SetString(PyExc_ValueError, "reduction_by_address: sizes do not agree");
        goto out;
    }
    piece -= piece % wd;
    tmp = PyMem_RawMalloc(2 * (size_t)piece); /* a peer's piece, our own */
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    char *dst = two ? (char *)ob.buf + lo * wd : ob.buf;
    o = by_address(&L, xb.buf, ob.buf, dst, xb.len, lo, hi, kind, op, piece, s, w1, t, w2, two,
                   phase, k, &pt, tmp);
    Py_END_ALLOW_THREADS
out:
    PyMem_RawFree(tmp);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&seg);
    if (PyErr_Occurred())
        return NULL;
    return outcome_tuple(o);
}

/* broadcast_by_address(layout, K, rank, addr, nbytes, cut, root, s, w, phase, k,
                        spin_ns, yields, nap_ns, budget_ns)

   pycoll.algorithms.direct's broadcast by address, whole, without the GIL:
   the same words and bytes as its Python steps.  [addr, addr + nbytes): this
   rank's buffer (the root's input, a reader's output), which the caller keeps
   alive for the call; every reader reads bytes [0, cut) of the
   root's, and the root writes [cut, len) into every reader's (none where cut
   is the whole length: then a reader neither claims nor posts).  Step s has
   posted word w.  Phases, from `phase` (and peer index k within it):

     0 claim s (the root, or a reader with a tail): every peer's done >= s - K;
     1 post buf as range s % K, done = s - 1, word = w;
     2 the root: for each reader (root + 1, root + 2, ...), wait for its word
       w and write the tail into it; a reader: wait for the root's word w and
       read [0, cut) of its buffer;
     3 done = s; the root waits until every reader's done reaches s, a reader
       with a tail until the root's does (its tail is written).

   It returns as reduction_by_address does (codes 3 and 4 in phase 2 are the
   root's write or a reader's read). */
static Outcome
broadcast_by(const Layout *L, char *buf, Py_ssize_t nbytes, Py_ssize_t cut, int root,
             uint64_t s, uint64_t w, int phase, int k, const Patience *pt)
{
    Outcome o = {0, phase, k, -1, 0};
    int n = L->n, r = L->rank, i = (int)(s % (uint64_t)L->K);
    int tail = cut < nbytes, poster = r == root || tail;
    for (; o.phase < 4; o.phase++, o.k = 0) {
        int ph = o.phase;
        if (ph == 0) {
            if (poster && claim_step(L, s, pt, &o))
                return o;
        } else if (ph == 1) {
            if (poster)
                post_step(L, s, buf, nbytes, w);
        } else if (ph == 2 && r == root) {
            for (; tail && o.k < n - 1; o.k++) {
                int j = (root + 1 + o.k) % n;
                if (await_peer(L, j, WORD(L, j, i), w, 1, pt, &o))
                    return o;
                if (move_range(L, j, i, (uint64_t)cut, buf + cut, (size_t)(nbytes - cut), 1, &o))
                    return o;
            }
        } else if (ph == 2) {
            if (await_peer(L, root, WORD(L, root, i), w, 1, pt, &o))
                return o;
            if (move_range(L, root, i, 0, buf, (size_t)cut, 0, &o))
                return o;
        } else if (r == root) {
            if (finish_step(L, s, pt, &o))
                return o;
        } else {
            __atomic_store_n(DONE(L, r), s, __ATOMIC_RELEASE);
            if (tail && await_peer(L, root, DONE(L, root), s, 0, pt, &o))
                return o;
        }
    }
    o.phase = 4;
    return o;
}

static PyObject *
step_broadcast_by_address(PyObject *self, PyObject *args)
{
    PyObject *layout;
    Layout L;
    Py_ssize_t nbytes, cut;
    unsigned long long addr, s, w;
    int K, rank, root, phase, k;
    Patience pt;
    if (!PyArg_ParseTuple(args, "OiiKnniKKiiLlLL:broadcast_by_address", &layout, &K, &rank,
                          &addr, &nbytes, &cut, &root, &s, &w, &phase, &k, &pt.spin_ns,
                          &pt.yields, &pt.nap_ns, &pt.budget_ns))
        return NULL;
    Py_buffer seg;
    if (open_layout(layout, K, rank, &L, &seg) < 0)
        return NULL;
    if (phase < 0 || phase > 3 || k < 0 || root < 0 || root >= L.n || cut < 0 || cut > nbytes) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "broadcast_by_address: bad root, cut or phase");
        return NULL;
    }
    Outcome o;
    Py_BEGIN_ALLOW_THREADS
    o = broadcast_by(&L, (char *)(uintptr_t)addr, nbytes, cut, root, s, w, phase, k, &pt);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&seg);
    if (PyErr_Occurred())
        return NULL;
    return outcome_tuple(o);
}
/* allgather_by_address(layout, K, rank, x, nbytes, own, out, out_nbytes, piece, s, w,
                        phase, k, spin_ns, yields, nap_ns, budget_ns)

   pycoll.algorithms.direct's allgather by address, whole, without the GIL:
   the same words and bytes as its Python steps.  [x, x + nbytes): this
   rank's block, which it writes at offset rank * nbytes of every peer's
   output; [out, out + out_nbytes): its own output, posted for the peers to
   write into; own: where its own block goes (0: the caller placed it), copied
   in pieces of `piece` bytes beside the writes, so that each piece of x is
   read from memory once.  Step s has posted word w.  Phases, from `phase`
   (and peer index k within it, peers taken in the order rank + 1, ...):

     0 claim s: every peer's done >= s - K;  1 post out as range s % K, done =
     s - 1, word = w;  2 wait for every peer's word w;  3 piece by piece: the
     own copy (copy_bytes), then a write into each peer's output
     (process_vm_writev) from that copy where there is one: in an output as
     the peers' are, it is aligned as theirs, and the write needs no detour
     (transports/_copies.h; 6.2 ms a call written from x, 3.8 from the copy,
     with an output 16 bytes into its page);
     4 done = s, wait until every peer's done reaches s (every block is in).

   It returns as reduction_by_address does (code 3 or 4 in phase 3: a write). */
static Outcome
allgather_by(const Layout *L, const char *x, Py_ssize_t nbytes, char *own, char *out,
             Py_ssize_t out_nbytes, Py_ssize_t piece, uint64_t s, uint64_t w, int phase, int k,
             const Patience *pt)
{
    Outcome o = {0, phase, k, -1, 0};
    int n = L->n, r = L->rank, i = (int)(s % (uint64_t)L->K);
    for (; o.phase < 5; o.phase++, o.k = 0) {
        int ph = o.phase;
        if (ph == 0) {
            if (claim_step(L, s, pt, &o))
                return o;
        } else if (ph == 1) {
            post_step(L, s, out, out_nbytes, w);
        } else if (ph == 2) {
            if (await_posts(L, i, w, pt, &o))
                return o;
        } else if (ph == 3) {
            uint64_t at = (uint64_t)r * (uint64_t)nbytes;
            for (Py_ssize_t a = 0; a < nbytes; a += piece) {
                size_t len = (size_t)(nbytes - a < piece ? nbytes - a : piece);
                if (own != NULL)
                    copy_bytes(own + a, x + a, len);
                for (int q = 0; q < n - 1; q++)
                    if (move_range(L, (r + 1 + q) % n, i, at + (uint64_t)a,
                                   own != NULL ? own + a : (char *)x + a, len, 1, &o))
                        return o;
            }
        } else if (finish_step(L, s, pt, &o)) {
            return o;
        }
    }
    o.phase = 5;
    return o;
}

static PyObject *
step_allgather_by_address(PyObject *self, PyObject *args)
{
    PyObject *layout;
    Layout L;
    Py_ssize_t nbytes, out_nbytes, piece;
    unsigned long long x, own, out, s, w;
    int K, rank, phase, k;
    Patience pt;
    if (!PyArg_ParseTuple(args, "OiiKnKKnnKKiiLlLL:allgather_by_address", &layout, &K, &rank,
                          &x, &nbytes, &own, &out, &out_nbytes, &piece, &s, &w, &phase, &k,
                          &pt.spin_ns, &pt.yields, &pt.nap_ns, &pt.budget_ns))
        return NULL;
    Py_buffer seg;
    if (open_layout(layout, K, rank, &L, &seg) < 0)
        return NULL;
    if (phase < 0 || phase > 4 || k < 0 || nbytes < 0 || piece <= 0 ||
        out_nbytes != nbytes * L.n) {
        PyBuffer_Release(&seg);
        PyErr_SetString(PyExc_ValueError, "allgather_by_address: bad sizes, piece or phase");
        return NULL;
    }
    Outcome o;
    Py_BEGIN_ALLOW_THREADS
    o = allgather_by(&L, (const char *)(uintptr_t)x, nbytes, (char *)(uintptr_t)own,
                     (char *)(uintptr_t)out, out_nbytes, piece, s, w, phase, k, &pt);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&seg);
    return outcome_tuple(o);
}
#define BY_ADDRESS                                                                          \
    {"reduction_by_address", (PyCFunction)step_reduction_by_address, METH_VARARGS,          \
     "A direct allreduce or reduce_scatter by address, whole, without the GIL."},           \
    {"broadcast_by_address", (PyCFunction)step_broadcast_by_address, METH_VARARGS,          \
     "A direct broadcast by address, whole, without the GIL."},                             \
    {"allgather_by_address", (PyCFunction)step_allgather_by_address, METH_VARARGS,          \
     "A direct allgather by address, whole, without the GIL."},
#else
#define BY_ADDRESS
#endif

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))step_reduce, METH_FASTCALL,
     "Reduce rows at addresses into a buffer, in rank order; False: not here."},
    {"stream_copy", (PyCFunction)(void (*)(void))step_stream_copy, METH_FASTCALL,
     "Copy bytes between addresses without the GIL, past the caches."},
    {"copy", (PyCFunction)(void (*)(void))step_copy, METH_FASTCALL,
     "dst's bytes = src's (two C-contiguous buffers of one length)."},
    BY_ADDRESS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pycoll._step",
    "The hot part of a small direct collective's step, compiled (see _step.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__step(void)
{
    s_seq = PyUnicode_InternFromString("seq");
    s_chain = PyUnicode_InternFromString("chain");
    s_last_big = PyUnicode_InternFromString("last_big");
    if (s_seq == NULL || s_chain == NULL || s_last_big == NULL || PyType_Ready(&StepType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StepType);
    if (PyModule_AddObject(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(&StepType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
