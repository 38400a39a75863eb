/* fireflyer.hfreduce._core: the Python face of the compiled core.
 *
 * reduce(out_ptr, out_dtype, in_ptrs, in_dtype, n, op, divisor=0) runs hfr_reduce on raw
 * addresses with the GIL released; fireflyer.hfreduce.engine.kernels wraps it for tensors, as it does
 * round(out_ptr, out_dtype, acc_ptr, n, divisor), the finish of an fp32 partial (hfr_round).
 * isa(), best_isa() and set_isa(name) report and lower the instruction set. At import,
 * FIREFLYER_HFREDUCE_ISA=avx512|avx2|portable asks for a lower one; a request this CPU
 * cannot honour (or a name it does not know) leaves the best one and says so in isa_note.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "node.h"

static int isa_by_name(const char *name) {
    for (int isa = HFR_ISA_PORTABLE; isa <= HFR_ISA_AVX512; isa++)
        if (strcmp(name, hfr_isa_name(isa)) == 0) return isa;
    return -1;
}

static PyObject *raise_rc(int rc) {
    PyErr_Format(rc == HFR_EDTYPE ? PyExc_TypeError : PyExc_ValueError, "hfreduce core: %s (code %d)",
                 hfr_strerror(rc), rc);
    return NULL;
}

static PyObject *py_reduce(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"out", "out_dtype", "ins", "in_dtype", "n", "op", "divisor", "tree", NULL};
    PyObject *out_obj, *ins_obj;
    int out_dtype, in_dtype, op, tree = 0;
    long long n, divisor = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OiOiLi|Lp", kwlist, &out_obj, &out_dtype, &ins_obj, &in_dtype, &n,
                                     &op, &divisor, &tree))
        return NULL;
    void *out = PyLong_AsVoidPtr(out_obj);
    if (out == NULL && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(ins_obj, "ins must be a sequence of addresses");
    if (seq == NULL) return NULL;
    Py_ssize_t nin = PySequence_Fast_GET_SIZE(seq);
    if (nin < 1 || nin > 1 << 20) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "hfreduce core: need 1 to %d inputs, got %zd", 1 << 20, nin);
        return NULL;
    }
    const void *stack[16];
    const void **ins = nin <= 16 ? stack : PyMem_Malloc(sizeof(void *) * (size_t)nin);
    if (ins == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < nin; k++) {
        ins[k] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, k));
        if (ins[k] == NULL && PyErr_Occurred()) {
            if (ins != stack) PyMem_Free(ins);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = (tree ? hfr_reduce_tree : hfr_reduce)(out, out_dtype, ins, (int)nin, in_dtype, (int64_t)n, op, (int64_t)divisor);
    Py_END_ALLOW_THREADS
    if (ins != stack) PyMem_Free(ins);
    if (rc != HFR_OK) return raise_rc(rc);
    Py_RETURN_NONE;
}

static PyObject *py_round(PyObject *self, PyObject *args) {
    PyObject *out_obj, *acc_obj;
    int out_dtype;
    long long n, divisor;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiOLL", &out_obj, &out_dtype, &acc_obj, &n, &divisor))
        return NULL;
    void *out = PyLong_AsVoidPtr(out_obj);
    if (out == NULL && PyErr_Occurred()) return NULL;
    const float *acc = PyLong_AsVoidPtr(acc_obj);
    if (acc == NULL && PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hfr_round(out, out_dtype, acc, (int64_t)n, (int64_t)divisor);
    Py_END_ALLOW_THREADS
    if (rc != HFR_OK) return raise_rc(rc);
    Py_RETURN_NONE;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(hfr_isa_name(hfr_isa()));
}

static PyObject *py_best_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(hfr_isa_name(hfr_isa_best()));
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    int isa = isa_by_name(name);
    if (isa < 0) {
        PyErr_Format(PyExc_ValueError, "unknown instruction set %R; choose avx512, avx2 or portable", arg);
        return NULL;
    }
    if (hfr_set_isa(isa) != HFR_OK) {
        PyErr_Format(PyExc_ValueError, "this CPU cannot run %s kernels; the best it has is %s", name,
                     hfr_isa_name(hfr_isa_best()));
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *hfr_py_node_run(PyObject *self, PyObject *args); /* node_py.c */
PyObject *hfr_py_tree_run(PyObject *self, PyObject *args); /* node_py.c */
PyObject *hfr_py_exchange_drive(PyObject *self, PyObject *args); /* node_py.c */

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))py_reduce, METH_VARARGS | METH_KEYWORDS,
     "reduce(out, out_dtype, ins, in_dtype, n, op, divisor=0, tree=False): hfr_reduce (tree: hfr_reduce_tree) on "
     "raw addresses, GIL released."},
    {"round", py_round, METH_VARARGS,
     "round(out, out_dtype, acc, n, divisor): hfr_round (an fp32 accumulation into a low precision), GIL released."},
    {"isa", py_isa, METH_NOARGS, "The instruction set reduce uses now: 'avx512', 'avx2' or 'portable'."},
    {"best_isa", py_best_isa, METH_NOARGS, "The best instruction set this CPU supports."},
    {"set_isa", py_set_isa, METH_O, "Use the named instruction set (at most best_isa())."},
    {"node_run", hfr_py_node_run, METH_VARARGS,
     "node_run(comm, job) -> (rc, stage, local_rank, chunk, late): one collective's chunks through the arena "
     "(node.h), GIL released."},
    {"tree_run", hfr_py_tree_run, METH_VARARGS,
     "tree_run(comm, job) -> (rc, link, sending, chunk, stage, local_rank, kind, seq, frame_chunk, nbytes, digest): "
     "one tree's reduce-up or broadcast-down of one collective over handed-over sockets (tree.h), GIL released."},
    {"exchange_drive", hfr_py_exchange_drive, METH_VARARGS,
     "exchange_drive(items, slice_ns, spin_ns) -> (rc, index): one synchronous exchange's transfers over rings and "
     "sockets, packed hfx_items written back in place (exchange.h), GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fireflyer.hfreduce._core", "hfreduce's compiled core: SIMD reduce kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *note = Py_None;
    Py_INCREF(note);
    const char *want = getenv("FIREFLYER_HFREDUCE_ISA");
    if (want != NULL && *want != '\0') {
        int isa = isa_by_name(want);
        Py_DECREF(note);
        if (isa < 0)
            note = PyUnicode_FromFormat("FIREFLYER_HFREDUCE_ISA=%s is not avx512, avx2 or portable; using %s", want,
                                        hfr_isa_name(hfr_isa()));
        else if (hfr_set_isa(isa) != HFR_OK)
            note = PyUnicode_FromFormat("FIREFLYER_HFREDUCE_ISA=%s: this CPU lacks it; using %s", want,
                                        hfr_isa_name(hfr_isa()));
        else {
            note = Py_None;
            Py_INCREF(note);
        }
        if (note == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddObject(m, "isa_note", note) < 0) {
        Py_DECREF(note);
        Py_DECREF(m);
        return NULL;
    }
    /* hfr_node_run itself, for the C++ door (backend/door.cpp), which calls it without Python */
    PyObject *run = PyCapsule_New((void *)hfr_node_run, NODE_RUN_CAPSULE, NULL);
    if (run == NULL || PyModule_AddObject(m, "node_run_capsule", run) < 0) {
        Py_XDECREF(run);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
