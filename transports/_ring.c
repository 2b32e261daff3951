/* transports._ring: a small message into and out of a shared-memory ring, and
   a large one's pieces through it, compiled; and the two atomic steps of a
   large message copied from both ends at once.

   transports/shm.py keeps a ring of slots per direction of a pair (its module
   docstring gives the layout and the protocol: the sender owns head, the
   receiver owns tail, each slot has four words of metadata).  A blocking
   point-to-point call of a few bytes spends most of its time in Python
   putting one message into a slot or taking one out; these two functions do
   that whole step in one call (ShmConnection.put_now and take_now, the only
   callers, pass the segment they map); put_pieces and take_pieces move the
   plain pieces of a large one (ShmConnection._progress_sends and
   _progress_recvs), waiting a bounded spin between pieces, so that both
   ends copy at once.  Everything else (queued messages, descriptors,
   mismatches, waits that back off, timeouts, a peer that died) stays in
   Python: a function here that cannot finish its step leaves the ring as it
   is and says so.  put and take hold the GIL throughout (take's spin is
   bounded); every function holds the mapping's export, so no other thread
   can close and unmap the segment while one runs.

   Every function takes the segment's mapping (an mmap) and offsets into it,
   and exports the mapping while it runs: a mapping already closed raises
   ValueError and nothing is touched.

   put(ring, sent, head, body, nbytes, tag) -> bool
       ring: (mapping, base, stride, meta, head_word, tail_word, nslots,
       slot_bytes), offsets into the mapping, of the outbound direction; sent: the messages published so far (the
       sender's copy of head).  When slot sent % nslots is free: copy the
       bytes of head and then of body into it (nbytes in all, the rest
       padding left as it is), write its metadata (nbytes, offset 0, no
       descriptor, tag), store head = sent + 1 (release) and return True.
       False: the ring is full, or nbytes does not fit a slot.

   take(ring, recvd, head, out, nbytes, tag, spins) -> int
       ring: the inbound direction, as above; recvd: the messages taken so far.
       Wait at most spins rounds for message recvd (acquire load of head).  If
       it is a single slot of nbytes at offset 0, tagged tag, whose first bytes
       equal those of head: copy the len(out) bytes after them into out,
       store tail = recvd + 1 (release) and return 1.  0: nothing arrived;
       -1: the next message is another one (left where it is).

   claim(mapping, offset, id, count) -> int
       The 64-bit word at offset holds a shared copy's id (upper 32 bits) and
       the index of its next unclaimed piece (lower 32).  If the id is id's
       lower 32 bits and an index below count is left, take it (a
       compare-and-swap, so two processes never take the same piece) and
       return it; else -1 (another copy's word, or every piece taken).

   add(mapping, offset, value) -> int
       Atomically add value to the 64-bit word at offset; the new value.

   put_pieces(ring, sent, src, off, piece, tag, spins) -> (sent, off)
       A large message through the slots (what ShmConnection._progress_sends
       does for one): from byte off of buffer src, put pieces of at most piece
       bytes into the next free slots, each at the page offset its bytes have
       in src (metadata: length, that offset, no descriptor, tag; head stored
       with release after each), until src is all out or no slot frees up
       within spins rounds of waiting (none before its first piece); returns
       the new sent and off.

   take_pieces(ring, recvd, dst, off, piece, tag, spins) -> (recvd, off, status)
       The other end (ShmConnection._progress_recvs for a receive into a
       buffer): copy the pieces of the message tagged tag into dst from byte
       off, each of min(piece, what is left) bytes, storing tail with release
       after each, until dst is full or no piece arrives within spins rounds
       (none before its first piece; status 0); status -1: the next slot is not such a piece (a descriptor,
       another tag or length), left where it is for the caller to judge.

   Both release the GIL while they copy and wait; the buffers and the mapping
   stay exported meanwhile, so nothing can unmap them.

   vm_copy(pid, local, remote, nbytes, write) -> None
       transports/_cma.py's cross-memory copy: nbytes between address local of
       this process and address remote of process pid, by process_vm_readv
       (write false) or process_vm_writev, repeated until all moved, without
       the GIL.  Raises OSError with the call's errno (ESRCH: the process is
       gone), or EFAULT where a call moved nothing.  The caller vouches for
       its local range (the kernel checks the remote one).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#include "_copies.h"

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

typedef struct {
    Py_buffer seg; /* the mapping, exported while a function runs */
    char *base;
    unsigned long long stride, nslots, slot_bytes;
    uint64_t *meta, *head, *tail;
} ring_t;

/* The address of the 64-bit word at offset off of the exported mapping seg, or
   NULL with an exception set when it lies outside it. */
static uint64_t *
word_at(Py_buffer *seg, PyObject *off_obj)
{
    unsigned long long off = PyLong_AsUnsignedLongLong(off_obj);
    if (off == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (off % 8 || off + 8 > (unsigned long long)seg->len) {
        PyErr_Format(PyExc_ValueError, "offset %llu is not a word of the mapping", off);
        return NULL;
    }
    return (uint64_t *)((char *)seg->buf + off);
}

/* Export the mapping (a closed one raises ValueError: nothing is touched) */
static int
export(PyObject *mm, Py_buffer *seg)
{
    return PyObject_GetBuffer(mm, seg, PyBUF_WRITABLE);
}

/* Export mapping mm into seg and find its word at offset off; NULL (seg not
   held) with an exception set when the mapping is closed or off is not in it. */
static uint64_t *
exported_word(PyObject *mm, PyObject *off, Py_buffer *seg)
{
    if (export(mm, seg) < 0)
        return NULL;
    uint64_t *w = word_at(seg, off);
    if (w == NULL)
        PyBuffer_Release(seg);
    return w;
}

static int
ring_of(PyObject *t, ring_t *r)
{
    unsigned long long v[7];
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 8) {
        PyErr_SetString(PyExc_TypeError, "ring must be (mapping, 7 integers)");
        return -1;
    }
    for (int k = 0; k < 7; k++) {
        v[k] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, k + 1));
        if (v[k] == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
    }
    r->stride = v[1];
    r->nslots = v[5];
    r->slot_bytes = v[6];
    if (r->nslots == 0) {
        PyErr_SetString(PyExc_ValueError, "ring has no slots");
        return -1;
    }
    if (export(PyTuple_GET_ITEM(t, 0), &r->seg) < 0)
        return -1;
    unsigned long long len = (unsigned long long)r->seg.len;
    if (v[0] + r->nslots * r->stride > len || r->slot_bytes > r->stride ||
        v[2] + 32 * r->nslots > len || v[3] + 8 > len || v[4] + 8 > len) {
        PyBuffer_Release(&r->seg);
        PyErr_SetString(PyExc_ValueError, "ring lies outside its mapping");
        return -1;
    }
    char *at = (char *)r->seg.buf;
    r->base = at + v[0];
    r->meta = (uint64_t *)(at + v[2]);
    r->head = (uint64_t *)(at + v[3]);
    r->tail = (uint64_t *)(at + v[4]);
    return 0;
}

static PyObject *
ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ring_t r;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "put takes 6 arguments");
        return NULL;
    }
    unsigned long long sent = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[4]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (ring_of(args[0], &r))
        return NULL;
    PyObject *ok = Py_False;
    if (nbytes > 0 && (unsigned long long)nbytes <= r.slot_bytes &&
        sent - __atomic_load_n(r.tail, __ATOMIC_ACQUIRE) < r.nslots) {
        Py_buffer h, b;
        if (PyObject_GetBuffer(args[2], &h, PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (PyObject_GetBuffer(args[3], &b, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&h);
            goto fail;
        }
        if (h.len + b.len > nbytes) {
            PyErr_Format(PyExc_ValueError, "put: %zd + %zd bytes for a %zd-byte message",
                         h.len, b.len, nbytes);
            PyBuffer_Release(&h);
            PyBuffer_Release(&b);
            goto fail;
        }
        unsigned long long slot = sent % r.nslots;
        char *dst = r.base + slot * r.stride;
        copy_bytes(dst, h.buf, (size_t)h.len);
        copy_bytes(dst + h.len, b.buf, (size_t)b.len);
        PyBuffer_Release(&h);
        PyBuffer_Release(&b);
        uint64_t *m = r.meta + 4 * slot;
        m[0] = (uint64_t)nbytes;
        m[1] = 0;
        m[2] = 0;
        m[3] = (uint64_t)tag;
        __atomic_store_n(r.head, (uint64_t)(sent + 1), __ATOMIC_RELEASE);
        ok = Py_True;
    }
    PyBuffer_Release(&r.seg);
    Py_INCREF(ok);
    return ok;
fail:
    PyBuffer_Release(&r.seg);
    return NULL;
}

static PyObject *
ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ring_t r;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "take takes 7 arguments");
        return NULL;
    }
    unsigned long long recvd = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[4]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[5]);
    long spins = PyLong_AsLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (ring_of(args[0], &r))
        return NULL;
    long got = 0;
    while (__atomic_load_n(r.head, __ATOMIC_ACQUIRE) <= recvd) {
        if (spins-- <= 0)
            goto done;
        RELAX();
    }
    unsigned long long slot = recvd % r.nslots;
    const uint64_t *m = r.meta + 4 * slot;
    got = -1;
    if (m[0] != (uint64_t)nbytes || m[1] != 0 || m[2] != 0 || m[3] != (uint64_t)tag ||
        (unsigned long long)nbytes > r.slot_bytes)
        goto done;
    Py_buffer h, o;
    if (PyObject_GetBuffer(args[2], &h, PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    if (PyObject_GetBuffer(args[3], &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&h);
        goto fail;
    }
    const char *src = r.base + slot * r.stride;
    if (h.len + o.len > nbytes) {
        PyErr_Format(PyExc_ValueError, "take: %zd + %zd bytes from a %zd-byte message", h.len,
                     o.len, nbytes);
        PyBuffer_Release(&h);
        PyBuffer_Release(&o);
        goto fail;
    }
    if (memcmp(src, h.buf, (size_t)h.len) == 0) {
        copy_bytes(o.buf, src + h.len, (size_t)o.len);
        __atomic_store_n(r.tail, (uint64_t)(recvd + 1), __ATOMIC_RELEASE);
        got = 1;
    }
    PyBuffer_Release(&h);
    PyBuffer_Release(&o);
done:
    PyBuffer_Release(&r.seg);
    return PyLong_FromLong(got);
fail:
    PyBuffer_Release(&r.seg);
    return NULL;
}

static PyObject *
ring_claim(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "claim takes 4 arguments");
        return NULL;
    }
    unsigned long long id = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long count = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer seg;
    uint64_t *w = exported_word(args[0], args[1], &seg);
    if (w == NULL)
        return NULL;
    long long got = -1;
    uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((v >> 32) != (id & 0xFFFFFFFFu) || (v & 0xFFFFFFFFu) >= count)
            break;
        if (__atomic_compare_exchange_n(w, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            got = (long long)(v & 0xFFFFFFFFu);
            break;
        }
    }
    PyBuffer_Release(&seg);
    return PyLong_FromLongLong(got);
}

static PyObject *
ring_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add takes 3 arguments");
        return NULL;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer seg;
    uint64_t *w = exported_word(args[0], args[1], &seg);
    if (w == NULL)
        return NULL;
    uint64_t got = __atomic_add_fetch(w, (uint64_t)v, __ATOMIC_ACQ_REL);
    PyBuffer_Release(&seg);
    return PyLong_FromUnsignedLongLong(got);
}

#define PAGE 4096ULL

/* The word at w once it is above value, or its last load after spins rounds
   of waiting. */
static inline uint64_t
await_above(const uint64_t *w, uint64_t value, long spins)
{
    uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    while (v <= value && spins-- > 0) {
        RELAX();
        v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    }
    return v;
}

/* put_pieces' and take_pieces' arguments.  Their loops wait a bounded spin
   for the next slot or piece only once the call has moved one: a call that
   finds nothing to do returns at once, so the caller's waiting policy (which
   backs off, and may have other requests to progress) stays in charge of
   the waits between messages, and the spin only keeps the two ends copying
   in step within one. */
static int
pieces_args(PyObject *const *args, Py_ssize_t nargs, const char *name,
            unsigned long long v[4], long *spins)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments", name);
        return -1;
    }
    const int at[4] = {1, 3, 4, 5}; /* sent or recvd, off, piece, tag */
    for (int k = 0; k < 4; k++) {
        v[k] = PyLong_AsUnsignedLongLong(args[at[k]]);
        if (v[k] == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
    }
    *spins = PyLong_AsLong(args[6]);
    if (*spins == -1 && PyErr_Occurred())
        return -1;
    if (v[2] == 0) {
        PyErr_Format(PyExc_ValueError, "%s: pieces of 0 bytes", name);
        return -1;
    }
    return 0;
}

/* The arguments of put_pieces and take_pieces, the ring exported into r and the
   message's buffer into buf (flags: PyBUF_*); -1, nothing held, on error. */
static int
pieces_open(PyObject *const *args, Py_ssize_t nargs, const char *name, int flags,
            unsigned long long v[4], long *spins, ring_t *r, Py_buffer *buf)
{
    if (pieces_args(args, nargs, name, v, spins) < 0 || ring_of(args[0], r))
        return -1;
    if (PyObject_GetBuffer(args[2], buf, flags) < 0) {
        PyBuffer_Release(&r->seg);
        return -1;
    }
    return 0;
}

static PyObject *
ring_put_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[4];
    long spins;
    ring_t r;
    Py_buffer src;
    if (pieces_open(args, nargs, "put_pieces", PyBUF_C_CONTIGUOUS, v, &spins, &r, &src) < 0)
        return NULL;
    unsigned long long sent = v[0], off = v[1], piece = v[2], tag = v[3];
    if (piece > r.slot_bytes || piece + PAGE > r.stride) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&r.seg);
        PyErr_SetString(PyExc_ValueError, "put_pieces: pieces larger than a slot");
        return NULL;
    }
    unsigned long long total = (unsigned long long)src.len;
    const char *from = (const char *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    while (off < total) {
        /* free while sent - tail < nslots, i.e. tail > sent - nslots; a wait
           spins only once this call has moved a piece (see pieces_args) */
        if (sent >= r.nslots &&
            await_above(r.tail, sent - r.nslots, sent != v[0] ? spins : 0) <= sent - r.nslots)
            break;
        unsigned long long n = total - off < piece ? total - off : piece;
        unsigned long long o = ((uintptr_t)(from + off)) % PAGE;
        unsigned long long slot = sent % r.nslots;
        copy_bytes(r.base + slot * r.stride + o, from + off, (size_t)n);
        uint64_t *m = r.meta + 4 * slot;
        m[0] = n;
        m[1] = o;
        m[2] = 0;
        m[3] = tag;
        __atomic_store_n(r.head, (uint64_t)(sent + 1), __ATOMIC_RELEASE);
        sent++;
        off += n;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&r.seg);
    return Py_BuildValue("KK", sent, off);
}

static PyObject *
ring_take_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[4];
    long spins;
    ring_t r;
    Py_buffer dst;
    if (pieces_open(args, nargs, "take_pieces", PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, v, &spins,
                    &r, &dst) < 0)
        return NULL;
    unsigned long long recvd = v[0], off = v[1], piece = v[2], tag = v[3];
    unsigned long long total = (unsigned long long)dst.len;
    char *to = (char *)dst.buf;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    while (off < total) {
        if (await_above(r.head, recvd, recvd != v[0] ? spins : 0) <= recvd)
            break;
        unsigned long long slot = recvd % r.nslots;
        const uint64_t *m = r.meta + 4 * slot;
        unsigned long long want = total - off < piece ? total - off : piece;
        if (m[3] != tag || m[2] != 0 || m[1] >= PAGE || m[0] != want ||
            want > r.slot_bytes || m[1] + want > r.stride) {
            status = -1;
            break;
        }
        copy_bytes(to + off, r.base + slot * r.stride + m[1], (size_t)want);
        __atomic_store_n(r.tail, (uint64_t)(recvd + 1), __ATOMIC_RELEASE);
        recvd++;
        off += want;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&r.seg);
    return Py_BuildValue("KKi", recvd, off, status);
}

static PyObject *
ring_vm_copy(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "vm_copy(pid, local, remote, nbytes, write)");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]);
    unsigned long long local = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long remote = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[3]);
    int write = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || write < 0)
        return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "vm_copy: nbytes < 0");
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = vm_move((pid_t)pid, (char *)(uintptr_t)local, remote, (size_t)nbytes, write);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"vm_copy", (PyCFunction)(void (*)(void))ring_vm_copy, METH_FASTCALL,
     "Copy bytes to or from another process's memory (process_vm_readv/writev)."},
    {"put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL,
     "Put a small message into the next free slot of a ring; False: none free."},
    {"take", (PyCFunction)(void (*)(void))ring_take, METH_FASTCALL,
     "Take the next message of a ring if it is the one expected (1), else 0 or -1."},
    {"claim", (PyCFunction)(void (*)(void))ring_claim, METH_FASTCALL,
     "Claim the next piece of a shared copy (its index), or -1."},
    {"add", (PyCFunction)(void (*)(void))ring_add, METH_FASTCALL,
     "Atomically add to a 64-bit word; the new value."},
    {"put_pieces", (PyCFunction)(void (*)(void))ring_put_pieces, METH_FASTCALL,
     "Put a large message's pieces into the free slots of a ring; (sent, off)."},
    {"take_pieces", (PyCFunction)(void (*)(void))ring_take_pieces, METH_FASTCALL,
     "Take a large message's pieces out of a ring; (recvd, off, status)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transports._ring",
    "A small message into and out of a shared-memory ring, compiled (see _ring.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__ring(void)
{
    return PyModule_Create(&module);
}
