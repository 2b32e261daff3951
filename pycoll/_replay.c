/* pycoll._replay: the replayed call's entry, compiled.

   A blocking call that the replay cache knows (pycoll.plans.Plan) goes through
   pycoll.dispatch.Dispatch.call and pycoll.engine.Engine.replay: a key, two
   dict lookups, a check that the arrays still look as they did, the
   communicator's lock, a sequence number and a record in the flight recorder,
   then the plan's step.  In Python that costs about 1.4 us of an 8 B allreduce
   at n = 2 on the 2-core machine, more than the step itself
   (docs/algorithms.md, "The compiled step and the compiled entry").  Entry does the same for the one
   common case, a plan of NumPy arrays that the plan holds, and hands every
   other call, unchanged, to the Python path it replaces:

     Entry(slow, plans, fam, engine, p2p, enter, leave, append, enabled, trace,
           fail, overlapped, ndarray, owner, weak)
     entry(coll, sendbuf, recvbuf, op, root, algorithm, async_op, stream)

   runs the call when async_op is False, stream None, root an int, nothing is
   in flight (fam.inflight), no point-to-point call is pending (p2p.live),
   tracing is off (enabled(trace) false), plans or weak holds the key (coll,
   id(sendbuf), id(recvbuf), op, root, algorithm) and that plan has a Fit
   whose arrays still fit, on the plan's thread (the key of the last call run
   it keeps, with its Fit, while owner.epoch stays: the same objects again
   skip the key and the lookup; forget() drops them, as the owner's clear
   does).  Otherwise it returns
   slow(coll, sendbuf, recvbuf, op, root, algorithm, async_op, stream).

   Running it is what Engine.replay does: enter(False) (else the slow path,
   which raises the concurrent-call error), engine.seq += 1, a record
   [seq, call, monotonic, None, "running"] appended, go(); an exception is
   handed to fail(record, exc), which raises it; leave(); fam.failed set
   meanwhile: overlapped(record), which raises; the record's end and "ok".
   The result is go()'s, or the Fit's res where go() returns None.

   data(a): the address of NumPy array a's first element, from the array
   struct (pycoll.buffers.data_ptr; __array_interface__ makes a dict for it).

   Fit(x, xw, o, go, res, call, tid, weak=False, ret=0): what a Plan's arrays
   look like (ndim, shape, strides, dtype, and writeable where they are
   written: x when xw, o always), read from NumPy's array struct, whose layout
   (PyArrayObject_fields: data, nd, dimensions, strides, base, descr, flags)
   is part of NumPy's ABI.  The constructor checks what it reads against the
   arrays' Python attributes and raises ValueError where they differ (the
   caller then makes no Fit).  A weak Fit (a plan of large arrays, which holds
   none) keeps weak references to them and their data pointers: it fits only
   the very objects, alive, at the same addresses.  ret: what a go() that
   returns None gives back: 0 res, 1 the call's sendbuf, 2 its recvbuf (a weak
   plan's SENDBUF and RECVBUF).

   A plan's key is looked up in plans, then in weak (the weak plans' dict).

   Kinds: a call with no plan whose kind (pycoll.plans.Kind, in the dict kinds
   under pycoll.plans.kind_key) has a kind's Fit (kind=1: Fit(x, xw, o, go,
   None, call, tid, False, ret, True, own), made of the kind's first arrays
   and holding none) runs here on the caller's own arrays: they must fit its
   layouts, the output may not overlap the input, and go(sendbuf, recvbuf)
   runs (go(sendbuf, sendbuf) for a kind without an output), after sendbuf
   is copied into recvbuf at byte own where own >= 0 (an allgather's own
   block).  go is a compiled Step, which takes any C-contiguous buffer of its
   bytes; the kinds of Fits are made for C-contiguous arrays alone
   (pycoll.plans.Plans.add_kind).  The last kind run is kept as the last
   plan is.  As Plans.known_kind does, the entry keeps weak references to a
   kind's last arrays in Kind.last: the same arrays again go to the slow
   path, which makes them a plan.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "pythread.h"

#include "../transports/_copies.h"

/* The head of NumPy's PyArrayObject_fields. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} ArrayHead;

#define WRITEABLE 0x0400 /* NPY_ARRAY_WRITEABLE */
#define MAXDIMS 64

/* ------------------------------------------------------------------ Fit */

typedef struct {
    int nd;
    int writeable; /* required */
    PyObject *descr;
    Py_ssize_t shape[MAXDIMS], strides[MAXDIMS];
} Layout;

typedef struct {
    PyObject_HEAD
    Layout x, o;
    int has_o;
    int weak, ret;
    int kind;                  /* a kind's Fit: holds no array, go(x, o) (go(x, x) with no o) */
    Py_ssize_t xbytes, obytes; /* a kind's arrays' bytes (C-contiguous) */
    Py_ssize_t own;            /* a kind's: x is first copied to byte own of o (< 0: not) */
    char *xptr, *optr; /* a weak Fit's arrays' data pointers */
    /* the plan's arrays (o: None where it has none); a weak Fit's: weak references */
    PyObject *xobj, *oobj;
    PyObject *go, *res, *call;
    unsigned long tid;
} Fit;

/* Whether a is the object that held (a Fit's xobj or oobj) stands for. */
static inline int
is_held(PyObject *a, PyObject *held, int weak)
{
    if (!weak || held == Py_None)
        return a == held;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(held, &obj) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(obj); /* alive while the caller holds a */
    return obj == a;
#else
    return PyWeakref_GET_OBJECT(held) == a;
#endif
}

static PyTypeObject *ndarray; /* set by the first Entry */

static int
layout_of(PyObject *a, int writeable, Layout *L)
{
    ArrayHead *h = (ArrayHead *)a;
    if (h->nd < 0 || h->nd > MAXDIMS) {
        PyErr_SetString(PyExc_ValueError, "Fit: an array of unexpected ndim");
        return -1;
    }
    L->nd = h->nd;
    L->writeable = writeable;
    for (int d = 0; d < h->nd; d++) {
        L->shape[d] = h->dimensions[d];
        L->strides[d] = h->strides[d];
    }
    L->descr = Py_NewRef(h->descr);
    /* what was read must be what Python sees */
    PyObject *shape = PyObject_GetAttrString(a, "shape");
    PyObject *strides = PyObject_GetAttrString(a, "strides");
    PyObject *dtype = PyObject_GetAttrString(a, "dtype");
    int ok = shape && strides && dtype && PyTuple_Check(shape) && PyTuple_Check(strides) &&
             PyTuple_GET_SIZE(shape) == h->nd && PyTuple_GET_SIZE(strides) == h->nd &&
             dtype == h->descr;
    for (int d = 0; ok && d < h->nd; d++)
        ok = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d)) == h->dimensions[d] &&
             PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, d)) == h->strides[d];
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    if (PyErr_Occurred())
        return -1;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "Fit: NumPy's array struct is not as expected");
        return -1;
    }
    return 0;
}

static inline int
fits(PyObject *a, const Layout *L)
{
    if (Py_TYPE(a) != ndarray)
        return 0;
    ArrayHead *h = (ArrayHead *)a;
    if (h->nd != L->nd || h->descr != L->descr || (L->writeable && !(h->flags & WRITEABLE)))
        return 0;
    for (int d = 0; d < L->nd; d++)
        if (h->dimensions[d] != L->shape[d] || h->strides[d] != L->strides[d])
            return 0;
    return 1;
}

static void
fit_dealloc(Fit *self)
{
    Py_XDECREF(self->x.descr);
    Py_XDECREF(self->o.descr);
    Py_XDECREF(self->xobj);
    Py_XDECREF(self->oobj);
    Py_XDECREF(self->go);
    Py_XDECREF(self->res);
    Py_XDECREF(self->call);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
fit_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *x, *o, *go, *res, *call;
    int xw, weak = 0, ret = 0, kind = 0;
    Py_ssize_t own = -1;
    unsigned long tid;
    if (!PyArg_ParseTuple(args, "OpOOOOk|pipn:Fit", &x, &xw, &o, &go, &res, &call, &tid, &weak,
                          &ret, &kind, &own))
        return NULL;
    if (kind && (weak || (own >= 0 && o == Py_None))) {
        PyErr_SetString(PyExc_ValueError,
                        "Fit: a kind's Fit is not weak, and copies only into an output");
        return NULL;
    }
    if (ret < 0 || ret > 2) {
        PyErr_SetString(PyExc_ValueError, "Fit: ret must be 0, 1 or 2");
        return NULL;
    }
    if (ndarray == NULL || Py_TYPE(x) != ndarray || (o != Py_None && Py_TYPE(o) != ndarray)) {
        PyErr_SetString(PyExc_ValueError, "Fit: NumPy arrays only");
        return NULL;
    }
    Fit *self = (Fit *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (layout_of(x, xw, &self->x) || (o != Py_None && layout_of(o, 1, &self->o))) {
        Py_DECREF(self);
        return NULL;
    }
    self->has_o = o != Py_None;
    self->weak = weak;
    self->ret = ret;
    self->kind = kind;
    self->own = own;
    if (kind) { /* the arrays' bytes, from the arrays (checked as layout_of checks) */
        PyObject *xb = PyObject_GetAttrString(x, "nbytes");
        PyObject *ob = xb == NULL || o == Py_None ? NULL : PyObject_GetAttrString(o, "nbytes");
        self->xbytes = xb == NULL ? -1 : PyLong_AsSsize_t(xb);
        self->obytes = ob == NULL ? 0 : PyLong_AsSsize_t(ob);
        Py_XDECREF(xb);
        Py_XDECREF(ob);
        if (!PyErr_Occurred() && own >= 0 && own + self->xbytes > self->obytes)
            PyErr_SetString(PyExc_ValueError, "Fit: the own block runs past the output");
        if (PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
        self->xobj = Py_NewRef(Py_None);
        self->oobj = Py_NewRef(Py_None);
    } else if (weak) {
        self->xptr = ((ArrayHead *)x)->data;
        self->optr = self->has_o ? ((ArrayHead *)o)->data : NULL;
        self->xobj = PyWeakref_NewRef(x, NULL);
        self->oobj = self->has_o ? PyWeakref_NewRef(o, NULL) : Py_NewRef(Py_None);
        if (self->xobj == NULL || self->oobj == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    } else {
        self->xobj = Py_NewRef(x);
        self->oobj = Py_NewRef(o);
    }
    self->go = Py_NewRef(go);
    self->res = Py_NewRef(res);
    self->call = Py_NewRef(call);
    self->tid = tid;
    return (PyObject *)self;
}

static PyTypeObject FitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pycoll._replay.Fit",
    .tp_basicsize = sizeof(Fit),
    .tp_dealloc = (destructor)fit_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What a plan's NumPy arrays look like, and how it runs (see _replay.c).",
    .tp_new = fit_new,
};

/* ------------------------------------------------------------------ Entry */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow, *plans, *fam, *engine, *p2p, *enter, *leave, *append, *enabled, *trace,
        *fail, *overlapped, *owner, *weak, *kinds;
    /* the last call run: its key, its Fit, and owner.epoch then */
    PyObject *last_key;
    Fit *last_fit;
    long last_epoch;
    /* the last kind run: its head (coll, op, root, algorithm), the Kind, its Fit,
       and owner.epoch then */
    PyObject *kind_head, *kind;
    Fit *kind_fit;
    long kind_epoch;
} Entry;

static PyObject *s_inflight, *s_failed, *s_live, *s_seq, *s_fit, *s_running, *s_ok, *s_epoch,
    *s_last, *one;

static void
entry_dealloc(Entry *self)
{
    Py_XDECREF(self->slow);
    Py_XDECREF(self->plans);
    Py_XDECREF(self->fam);
    Py_XDECREF(self->engine);
    Py_XDECREF(self->p2p);
    Py_XDECREF(self->enter);
    Py_XDECREF(self->leave);
    Py_XDECREF(self->append);
    Py_XDECREF(self->enabled);
    Py_XDECREF(self->trace);
    Py_XDECREF(self->fail);
    Py_XDECREF(self->overlapped);
    Py_XDECREF(self->owner);
    Py_XDECREF(self->weak);
    Py_XDECREF(self->kinds);
    Py_XDECREF(self->last_key);
    Py_XDECREF(self->last_fit);
    Py_XDECREF(self->kind_head);
    Py_XDECREF(self->kind_fit);
    Py_XDECREF(self->kind);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *entry_vectorcall(PyObject *, PyObject *const *, size_t, PyObject *);

static PyObject *
entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *a[16];
    if (!PyArg_UnpackTuple(args, "Entry", 16, 16, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6],
                           &a[7], &a[8], &a[9], &a[10], &a[11], &a[12], &a[13], &a[14], &a[15]))
        return NULL;
    if (!PyDict_Check(a[1]) || !PyDict_Check(a[14]) || !PyDict_Check(a[15]) ||
        !PyType_Check(a[12])) {
        PyErr_SetString(PyExc_TypeError,
                        "Entry: plans, weak and kinds must be dicts, ndarray a type");
        return NULL;
    }
    if (ndarray == NULL) {
        ndarray = (PyTypeObject *)Py_NewRef(a[12]);
    }
    Entry *self = (Entry *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = entry_vectorcall;
    PyObject **f[12] = {&self->slow,   &self->plans, &self->fam,     &self->engine,
                        &self->p2p,    &self->enter, &self->leave,   &self->append,
                        &self->enabled, &self->trace, &self->fail, &self->overlapped};
    for (int k = 0; k < 12; k++)
        *f[k] = Py_NewRef(a[k]);
    self->owner = Py_NewRef(a[13]);
    self->weak = Py_NewRef(a[14]);
    self->kinds = Py_NewRef(a[15]);
    self->last_epoch = -1;
    self->kind_epoch = -1;
    return (PyObject *)self;
}

/* The attribute of o as a truth value; -1 on error. */
static int
attr_true(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static PyObject *
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock */
    return PyFloat_FromDouble((double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
}

/* The owner's (the plans') epoch; -1 with an exception on error. */
static long
owner_epoch(Entry *self)
{
    PyObject *ep = PyObject_GetAttr(self->owner, s_epoch);
    if (ep == NULL)
        return -1;
    long epoch = PyLong_AsLong(ep);
    Py_DECREF(ep);
    return epoch;
}

/* The Fit of the plan under the call's key, or NULL (no error) when the call
   is not one this entry runs; epoch: the owner's now. */
static Fit *
find(Entry *self, PyObject *const *args, long epoch)
{
    PyObject *root = args[4];
    Fit *F = self->last_fit;
    PyObject *k = self->last_key;
    /* The same objects as the last call run, and nothing forgotten since (a
       clear moves the epoch): its Fit.  The Fit and the key hold every object
       compared, so none of them can be another at the same address. */
    if (F != NULL && epoch == self->last_epoch && is_held(args[1], F->xobj, F->weak) &&
        is_held(args[2], F->oobj, F->weak) &&
        args[0] == PyTuple_GET_ITEM(k, 0) && args[3] == PyTuple_GET_ITEM(k, 3) &&
        root == PyTuple_GET_ITEM(k, 4) && args[5] == PyTuple_GET_ITEM(k, 5)) {
        Py_INCREF(F);
        goto check;
    }
    PyObject *key = PyTuple_New(6);
    if (key == NULL)
        return NULL;
    PyObject *xid = PyLong_FromVoidPtr(args[1]);
    PyObject *oid = PyLong_FromVoidPtr(args[2]);
    if (xid == NULL || oid == NULL) {
        Py_XDECREF(xid);
        Py_XDECREF(oid);
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, Py_NewRef(args[0]));
    PyTuple_SET_ITEM(key, 1, xid);
    PyTuple_SET_ITEM(key, 2, oid);
    PyTuple_SET_ITEM(key, 3, Py_NewRef(args[3]));
    PyTuple_SET_ITEM(key, 4, Py_NewRef(root));
    PyTuple_SET_ITEM(key, 5, Py_NewRef(args[5]));
    PyObject *p = PyDict_GetItemWithError(self->plans, key); /* borrowed */
    if (p == NULL && !PyErr_Occurred())
        p = PyDict_GetItemWithError(self->weak, key);
    if (p == NULL) {
        Py_DECREF(key);
        PyErr_Clear(); /* an unhashable op or algorithm: the slow path says why */
        return NULL;
    }
    PyObject *fit = PyObject_GetAttr(p, s_fit);
    if (fit == NULL) {
        Py_DECREF(key);
        PyErr_Clear();
        return NULL;
    }
    if (Py_TYPE(fit) != &FitType) {
        Py_DECREF(key);
        Py_DECREF(fit);
        return NULL;
    }
    F = (Fit *)fit;
    Py_INCREF(F);
    Py_XSETREF(self->last_fit, F);
    Py_XSETREF(self->last_key, key);
    self->last_epoch = epoch;
check:
    if (!fits(args[1], &F->x) || (F->has_o && !fits(args[2], &F->o)) ||
        PyThread_get_thread_ident() != F->tid ||
        (F->weak && (((ArrayHead *)args[1])->data != F->xptr ||
                     (F->has_o && ((ArrayHead *)args[2])->data != F->optr)))) {
        Py_DECREF(F);
        return NULL;
    }
    return F;
}

/* A tuple of nd sizes (an array's shape or strides). */
static PyObject *
sizes(int nd, const Py_ssize_t *v)
{
    PyObject *t = PyTuple_New(nd);
    for (int d = 0; t != NULL && d < nd; d++) {
        PyObject *i = PyLong_FromSsize_t(v[d]);
        if (i == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, d, i);
    }
    return t;
}

/* The Fit of the kind of this call (pycoll.plans.Kind, under
   pycoll.plans.kind_key: (coll, op, root, algorithm), this thread, and each
   array's dtype, shape and strides), or NULL (no error) where there is none
   or these arrays may not use it: an array written that is not writeable, or
   an output that overlaps the input (the kinds of Fits take C-contiguous
   arrays alone, so the ranges tell). */
static Fit *
find_kind(Entry *self, PyObject *const *args, long epoch)
{
    PyObject *x = args[1], *o = args[2];
    int has_o = o != Py_None;
    if (Py_TYPE(x) != ndarray || (has_o && Py_TYPE(o) != ndarray) ||
        PyDict_GET_SIZE(self->kinds) == 0)
        return NULL;
    ArrayHead *xh = (ArrayHead *)x, *oh = (ArrayHead *)o;
    unsigned long tid = PyThread_get_thread_ident();
    Fit *F = self->kind_fit;
    PyObject *h = self->kind_head;
    if (F != NULL && epoch == self->kind_epoch && args[0] == PyTuple_GET_ITEM(h, 0) &&
        args[3] == PyTuple_GET_ITEM(h, 1) && args[4] == PyTuple_GET_ITEM(h, 2) &&
        args[5] == PyTuple_GET_ITEM(h, 3) && F->has_o == has_o && fits(x, &F->x) &&
        (!has_o || fits(o, &F->o))) {
        Py_INCREF(F);
        goto check;
    }
    PyObject *head = PyTuple_Pack(4, args[0], args[3], args[4], args[5]);
    int len = has_o ? 8 : 5;
    PyObject *key = head == NULL ? NULL : PyTuple_New(len);
    if (key == NULL) {
        Py_XDECREF(head);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, Py_NewRef(head));
    PyTuple_SET_ITEM(key, 1, PyLong_FromUnsignedLong(tid));
    PyTuple_SET_ITEM(key, 2, Py_NewRef(xh->descr));
    PyTuple_SET_ITEM(key, 3, sizes(xh->nd, xh->dimensions));
    PyTuple_SET_ITEM(key, 4, sizes(xh->nd, xh->strides));
    if (has_o) {
        PyTuple_SET_ITEM(key, 5, Py_NewRef(oh->descr));
        PyTuple_SET_ITEM(key, 6, sizes(oh->nd, oh->dimensions));
        PyTuple_SET_ITEM(key, 7, sizes(oh->nd, oh->strides));
    }
    for (int k = 1; k < len; k++)
        if (PyTuple_GET_ITEM(key, k) == NULL) {
            Py_DECREF(key);
            Py_DECREF(head);
            return NULL;
        }
    PyObject *kd = PyDict_GetItemWithError(self->kinds, key); /* borrowed */
    Py_DECREF(key);
    PyObject *fit = kd == NULL ? NULL : PyObject_GetAttr(kd, s_fit);
    if (fit == NULL || Py_TYPE(fit) != &FitType || !((Fit *)fit)->kind) {
        Py_XDECREF(fit);
        Py_DECREF(head);
        PyErr_Clear(); /* no kind, or none of this form, or an unhashable op: the slow path */
        return NULL;
    }
    F = (Fit *)fit;
    Py_INCREF(F);
    Py_XSETREF(self->kind_fit, F);
    Py_XSETREF(self->kind_head, head);
    Py_XSETREF(self->kind, Py_NewRef(kd)); /* for its last arrays (below) */
    self->kind_epoch = epoch;
    if (F->has_o != has_o || !fits(x, &F->x) || (has_o && !fits(o, &F->o))) {
        Py_DECREF(F);
        return NULL;
    }
check:
    if (F->tid != tid ||
        (has_o && xh->data < oh->data + F->obytes && oh->data < xh->data + F->xbytes)) {
        Py_DECREF(F);
        return NULL;
    }
    /* The same arrays as the kind's last call: the slow path, whose
       Plans.known_kind sees them there too and makes them a plan.  Else they
       become its last (weak references, as known_kind keeps them). */
    PyObject *last = PyObject_GetAttr(self->kind, s_last);
    if (last == NULL) {
        Py_DECREF(F);
        PyErr_Clear();
        return NULL;
    }
    int same = PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 2 &&
               is_held(x, PyTuple_GET_ITEM(last, 0), 1) &&
               (PyTuple_GET_ITEM(last, 1) == Py_None || is_held(o, PyTuple_GET_ITEM(last, 1), 1));
    Py_DECREF(last);
    PyObject *xr = same ? NULL : PyWeakref_NewRef(x, NULL);
    PyObject *orf = xr == NULL || !has_o ? Py_NewRef(Py_None) : PyWeakref_NewRef(o, NULL);
    PyObject *pair = xr == NULL || orf == NULL ? NULL : PyTuple_Pack(2, xr, orf);
    Py_XDECREF(xr);
    Py_XDECREF(orf);
    if (pair == NULL || PyObject_SetAttr(self->kind, s_last, pair) < 0) {
        Py_XDECREF(pair);
        Py_DECREF(F);
        PyErr_Clear(); /* same, or no memory for the references: the slow path */
        return NULL;
    }
    Py_DECREF(pair);
    return F;
}

static PyObject *
entry_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Entry *self = (Entry *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* the call's own arguments first (pointer compares): an asynchronous call, a
       stream or a root that is not an int goes to the slow path at once */
    if (nargs != 8 || kwnames != NULL || args[6] != Py_False || args[7] != Py_None ||
        !PyLong_CheckExact(args[4]))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    int busy = attr_true(self->fam, s_inflight);
    if (busy < 0)
        return NULL;
    int live = busy ? 0 : attr_true(self->p2p, s_live);
    if (live < 0)
        return NULL;
    PyObject *tr = (busy || live) ? NULL : PyObject_CallOneArg(self->enabled, self->trace);
    int traced = tr == NULL ? 1 : PyObject_IsTrue(tr);
    Py_XDECREF(tr);
    if (PyErr_Occurred())
        return NULL;
    Fit *F = NULL;
    if (!traced) {
        long epoch = owner_epoch(self);
        if (!(epoch == -1 && PyErr_Occurred()))
            F = find(self, args, epoch);
        if (F == NULL && !PyErr_Occurred())
            F = find_kind(self, args, epoch);
    }
    if (F == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    /* Engine.replay */
    PyObject *got = PyObject_CallOneArg(self->enter, Py_False);
    if (got == NULL) {
        Py_DECREF(F);
        return NULL;
    }
    int entered = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (entered <= 0) { /* another thread's call runs: the slow path raises */
        Py_DECREF(F);
        return entered < 0 ? NULL : PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    PyObject *result = NULL, *rec = NULL, *seq = NULL, *t0 = NULL;
    PyObject *old = PyObject_GetAttr(self->engine, s_seq);
    if (old != NULL) {
        seq = PyNumber_Add(old, one);
        Py_DECREF(old);
    }
    if (seq == NULL || PyObject_SetAttr(self->engine, s_seq, seq) < 0 || (t0 = now()) == NULL ||
        (rec = PyList_New(5)) == NULL) {
        Py_XDECREF(seq);
        Py_XDECREF(t0);
        goto leave;
    }
    PyList_SET_ITEM(rec, 0, seq);
    PyList_SET_ITEM(rec, 1, Py_NewRef(F->call));
    PyList_SET_ITEM(rec, 2, t0);
    PyList_SET_ITEM(rec, 3, Py_NewRef(Py_None));
    PyList_SET_ITEM(rec, 4, Py_NewRef(s_running));
    PyObject *r = PyObject_CallOneArg(self->append, rec);
    if (r == NULL)
        goto leave;
    Py_DECREF(r);
    if (F->kind) {
        PyObject *xo[2] = {args[1], F->has_o ? args[2] : args[1]};
        if (F->own >= 0) /* the rank's own block, as the envelope copies it */
            copy_bytes(((ArrayHead *)args[2])->data + F->own, ((ArrayHead *)args[1])->data,
                   (size_t)F->xbytes);
        result = PyObject_Vectorcall(F->go, xo, 2, NULL);
    } else {
        result = PyObject_CallNoArgs(F->go);
    }
    if (result == NULL) { /* fail(rec, exc) records it and raises it as pycoll's */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        if (tb != NULL)
            PyException_SetTraceback(v, tb);
        PyObject *f = PyObject_CallFunctionObjArgs(self->fail, rec, v, NULL);
        Py_XDECREF(f); /* it raises: f is NULL */
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        if (f != NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_SystemError, "Entry: fail() returned");
    }
leave:
    {
        PyObject *t, *v, *tb; /* leave() runs with no exception set */
        PyErr_Fetch(&t, &v, &tb);
        PyObject *l = PyObject_CallNoArgs(self->leave);
        if (t != NULL) {
            Py_XDECREF(l);
            PyErr_Restore(t, v, tb);
        } else if (l == NULL) {
            Py_CLEAR(result);
        } else {
            Py_DECREF(l);
        }
    }
    if (result == NULL) {
        Py_XDECREF(rec);
        Py_DECREF(F);
        return NULL;
    }
    int failed = attr_true(self->fam, s_failed);
    if (failed != 0) { /* another thread's call came in meanwhile */
        Py_DECREF(result);
        if (failed > 0) {
            PyObject *o = PyObject_CallOneArg(self->overlapped, rec);
            Py_XDECREF(o);
        }
        Py_DECREF(rec);
        Py_DECREF(F);
        return NULL;
    }
    PyObject *t1 = now();
    if (t1 == NULL || PyList_SetItem(rec, 3, t1) < 0) {
        Py_DECREF(result);
        Py_DECREF(rec);
        Py_DECREF(F);
        return NULL;
    }
    PyList_SetItem(rec, 4, Py_NewRef(s_ok));
    Py_DECREF(rec);
    if (result == Py_None) {
        Py_DECREF(result);
        result = Py_NewRef(F->ret == 1 ? args[1] : F->ret == 2 ? args[2] : F->res);
    }
    Py_DECREF(F);
    return result;
}

static PyObject *
entry_forget(Entry *self, PyObject *unused)
{
    Py_CLEAR(self->last_key);
    Py_CLEAR(self->last_fit);
    Py_CLEAR(self->kind_head);
    Py_CLEAR(self->kind_fit);
    Py_CLEAR(self->kind);
    self->last_epoch = self->kind_epoch = -1;
    Py_RETURN_NONE;
}

static PyMethodDef entry_methods[] = {
    {"forget", (PyCFunction)entry_forget, METH_NOARGS,
     "Drop the last call's key and Fit (and what they hold: its arrays and step)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pycoll._replay.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_vectorcall_offset = offsetof(Entry, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A communicator's entry for replayed calls (see _replay.c).",
    .tp_methods = entry_methods,
    .tp_new = entry_new,
};

/* data(a): the address of NumPy array a's first element, read from the array
   struct (the data pointer of __array_interface__, without making its dict). */
static PyObject *
replay_data(PyObject *unused, PyObject *a)
{
    if (ndarray == NULL || Py_TYPE(a) != ndarray) {
        PyErr_SetString(PyExc_TypeError, "data: a NumPy ndarray (exactly)");
        return NULL;
    }
    return PyLong_FromVoidPtr(((ArrayHead *)a)->data);
}

static PyMethodDef module_methods[] = {
    {"data", (PyCFunction)replay_data, METH_O,
     "The address of a NumPy array's first element (its __array_interface__ data)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pycoll._replay",
    "The replayed call's entry, compiled (see _replay.c).", -1, module_methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__replay(void)
{
    s_inflight = PyUnicode_InternFromString("inflight");
    s_failed = PyUnicode_InternFromString("failed");
    s_live = PyUnicode_InternFromString("live");
    s_seq = PyUnicode_InternFromString("seq");
    s_fit = PyUnicode_InternFromString("fit");
    s_running = PyUnicode_InternFromString("running");
    s_ok = PyUnicode_InternFromString("ok");
    s_epoch = PyUnicode_InternFromString("epoch");
    s_last = PyUnicode_InternFromString("last");
    one = PyLong_FromLong(1);
    if (!one || !s_epoch || !s_last || !s_inflight || !s_failed || !s_live || !s_seq || !s_fit || !s_running || !s_ok ||
        PyType_Ready(&FitType) < 0 || PyType_Ready(&EntryType) < 0)
        return NULL;
    if (ndarray == NULL) { /* data() needs it before any Entry */
        PyObject *np = PyImport_ImportModule("numpy");
        PyObject *t = np == NULL ? NULL : PyObject_GetAttrString(np, "ndarray");
        Py_XDECREF(np);
        if (t == NULL)
            return NULL;
        if (!PyType_Check(t)) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_TypeError, "numpy.ndarray is not a type");
            return NULL;
        }
        ndarray = (PyTypeObject *)t;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FitType);
    Py_INCREF(&EntryType);
    if (PyModule_AddObject(m, "Fit", (PyObject *)&FitType) < 0 ||
        PyModule_AddObject(m, "Entry", (PyObject *)&EntryType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
