/* pycoll._step: the hot part of a small direct collective's step, compiled.

   A prepared step of pycoll.algorithms.direct (one slot of the group segment,
   see transports/shm_group.py) copies its input into its slot, publishes the
   step, waits for the peers' words and reduces their slots in rank order.  In
   Python those five pieces cost about 2.7 us of an 8 B allreduce at n = 2 on
   the 2-core machine; here one call does the first three, another the
   reduction (docs/algorithms.md, "The compiled step").  Everything the
   protocol decides stays in Python: which words, which slots, the chain of
   fingerprints, claims, back-off, mismatches and timeouts.  These functions
   only move bytes and words at the addresses they are given, so a caller that
   gets an address wrong corrupts memory: pycoll.algorithms.direct is the only
   caller, with addresses of the segment it maps.  Every function holds the GIL
   throughout (its spins are bounded), so no other thread can close and unmap
   the segment while one runs; a closed communicator never reaches them.

   post_wait(x, slot, nbytes, done, done_value, posted, word, peers, spins) -> int
       Copy buffer x, which must hold nbytes, into address slot (x None:
       nothing), store
       done_value at done and then word at posted (release stores: the slot's
       bytes are visible first), then load the 64-bit words at the addresses of
       the tuple peers (acquire loads) until each equals word, spinning at most
       spins rounds in all.  Returns -1 when every peer posted word, else the
       index in peers of the first that has not (the caller waits for it and
       the rest the slow way).

   reduce(op, kind, out, count, rows) -> bool
       out = ((rows[0] OP rows[1]) OP rows[2]) ... elementwise, rows a tuple of
       addresses of count elements each, out a writable buffer of count
       elements that may be one of the rows.  op: 0 sum, 1 prod, 2 min, 3 max, 4 band, 5 bor,
       6 bxor; kind: the dtype, 'b' 'B' 'h' 'H' 'i' 'I' 'q' 'Q' (integers of
       1, 2, 4, 8 bytes, signed or not) or 'f' 'd' (float32, float64: sum and
       prod only, where IEEE arithmetic gives NumPy's bits).  Returns False,
       touching nothing, for any other op and kind: the caller reduces.

   store(addr, value)
       A release store of a 64-bit word (a step's "done").

   wait(peers, word, spins) -> int
       post_wait's wait alone (a broadcast's reader, which posts nothing).

   copy_blocks(out, block, sources) -> None
       Copy block bytes from each address of the tuple sources into block j of
       the writable buffer out (len(sources) blocks long); a source of 0 is
       skipped (the rank's own block).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static int
addr_of(PyObject *o, char **p)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *p = (char *)(uintptr_t)v;
    return 0;
}

/* Wait for the 64-bit words at the addresses of the tuple peers to equal word
   (acquire loads), at most spins rounds in all: -1, or the index of the first
   peer whose word is not there. */
static PyObject *
spin(PyObject *peers, unsigned long long word, long spins)
{
    Py_ssize_t n = PyTuple_GET_SIZE(peers);
    for (Py_ssize_t k = 0; k < n; k++) {
        char *at;
        if (addr_of(PyTuple_GET_ITEM(peers, k), &at))
            return NULL;
        while (__atomic_load_n((uint64_t *)at, __ATOMIC_ACQUIRE) != (uint64_t)word) {
            if (spins-- <= 0)
                return PyLong_FromSsize_t(k);
            RELAX();
        }
    }
    return PyLong_FromLong(-1);
}

static PyObject *
step_post_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    char *slot, *done, *posted;
    unsigned long long done_value, word;
    Py_ssize_t nbytes;
    long spins;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "post_wait takes 9 arguments");
        return NULL;
    }
    if (addr_of(args[1], &slot) || addr_of(args[3], &done) || addr_of(args[5], &posted))
        return NULL;
    nbytes = PyLong_AsSsize_t(args[2]);
    done_value = PyLong_AsUnsignedLongLong(args[4]);
    word = PyLong_AsUnsignedLongLong(args[6]);
    spins = PyLong_AsLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *peers = args[7];
    if (!PyTuple_Check(peers)) {
        PyErr_SetString(PyExc_TypeError, "peers must be a tuple of addresses");
        return NULL;
    }
    if (args[0] != Py_None) {
        Py_buffer x;
        if (PyObject_GetBuffer(args[0], &x, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (x.len != nbytes) {
            PyBuffer_Release(&x);
            PyErr_Format(PyExc_ValueError, "post_wait: %zd bytes for a %zd-byte step",
                         x.len, nbytes);
            return NULL;
        }
        memcpy(slot, x.buf, (size_t)nbytes);
        PyBuffer_Release(&x);
    }
    __atomic_store_n((uint64_t *)done, (uint64_t)done_value, __ATOMIC_RELEASE);
    __atomic_store_n((uint64_t *)posted, (uint64_t)word, __ATOMIC_RELEASE);
    return spin(peers, word, spins);
}

static PyObject *
step_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "wait takes 3 arguments");
        return NULL;
    }
    unsigned long long word = PyLong_AsUnsignedLongLong(args[1]);
    long spins = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "peers must be a tuple of addresses");
        return NULL;
    }
    return spin(args[0], word, spins);
}

static PyObject *
step_copy_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_blocks takes 3 arguments");
        return NULL;
    }
    Py_ssize_t block = PyLong_AsSsize_t(args[1]);
    if (block < 0 && PyErr_Occurred())
        return NULL;
    PyObject *srcs = args[2];
    if (!PyTuple_Check(srcs)) {
        PyErr_SetString(PyExc_TypeError, "sources must be a tuple of addresses");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(srcs);
    Py_buffer o;
    if (PyObject_GetBuffer(args[0], &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (o.len != n * block) {
        PyBuffer_Release(&o);
        PyErr_Format(PyExc_ValueError, "copy_blocks: a %zd-byte output for %zd blocks of %zd",
                     o.len, n, block);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        char *src;
        if (addr_of(PyTuple_GET_ITEM(srcs, j), &src)) {
            PyBuffer_Release(&o);
            return NULL;
        }
        if (src)
            memcpy((char *)o.buf + j * block, src, (size_t)block);
    }
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
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

static PyObject *
step_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    char *at;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store takes 2 arguments");
        return NULL;
    }
    if (addr_of(args[0], &at))
        return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    __atomic_store_n((uint64_t *)at, (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"post_wait", (PyCFunction)(void (*)(void))step_post_wait, METH_FASTCALL,
     "Copy in, publish a step, and wait briefly for the peers' words."},
    {"reduce", (PyCFunction)(void (*)(void))step_reduce, METH_FASTCALL,
     "Reduce rows at addresses into a buffer, in rank order; False: not here."},
    {"store", (PyCFunction)(void (*)(void))step_store, METH_FASTCALL,
     "A release store of a 64-bit word."},
    {"wait", (PyCFunction)(void (*)(void))step_wait, METH_FASTCALL,
     "Wait briefly for the peers' words."},
    {"copy_blocks", (PyCFunction)(void (*)(void))step_copy_blocks, METH_FASTCALL,
     "Copy blocks from addresses into consecutive blocks of a buffer."},
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
    return PyModule_Create(&module);
}
