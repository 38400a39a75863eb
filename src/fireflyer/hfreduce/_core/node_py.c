/* The Python doors to hfr_node_run, hfr_tree_run and hfx_drive.
 *
 * _core.node_run(comm: bytes, job: bytes) -> (rc, stage, local_rank, chunk, late):
 * comm and job are the int64 fields of hfr_comm and hfr_job (node.h) packed in order. The GIL is
 * released for the whole run, so the engine's other threads (the trees) go on meanwhile; on the
 * main thread it is taken back between futex slices to run pending signal handlers, and a
 * handler's exception (Ctrl-C's KeyboardInterrupt) ends the run and is raised from here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "exchange.h"
#include "node.h"
#include "tree.h"

typedef struct {
    PyThreadState *save;
} interrupt_state;

/* Python's main thread, as the threading module names it (the one whose signal handlers run). */
static unsigned long main_ident(void) {
    static unsigned long ident = 0;
    if (!ident) {
        PyObject *threading = PyImport_ImportModule("threading");
        PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
        PyObject *id = main ? PyObject_GetAttrString(main, "ident") : NULL;
        if (id)
            ident = PyLong_AsUnsignedLong(id);
        Py_XDECREF(id);
        Py_XDECREF(main);
        Py_XDECREF(threading);
        if (PyErr_Occurred())
            PyErr_Clear();
    }
    return ident;
}

/* The interrupt hook: take the GIL back for a moment and run any pending signal handler; a
 * handler that raised (KeyboardInterrupt) stops the run, its exception left set. */
static int signal_pending(void *arg) {
    interrupt_state *is = (interrupt_state *)arg;
    PyEval_RestoreThread(is->save);
    int raised = PyErr_CheckSignals() != 0;
    is->save = PyEval_SaveThread();
    return raised;
}

/* The (comm, job) byte strings of a run, copied into c and job (job_size bytes): 0, or -1 with an error set. */
static int unpack(PyObject *args, const char *name, hfr_comm *c, void *job, size_t job_size) {
    Py_buffer comm, spec;
    if (!PyArg_ParseTuple(args, "y*y*", &comm, &spec))
        return -1;
    int ok = comm.len == (Py_ssize_t)sizeof *c && spec.len == (Py_ssize_t)job_size;
    if (ok) {
        memcpy(c, comm.buf, sizeof *c);
        memcpy(job, spec.buf, job_size);
    } else {
        PyErr_Format(PyExc_ValueError, "%s: comm must be %zd bytes and job %zd, got %zd and %zd", name, sizeof *c,
                     job_size, comm.len, spec.len);
    }
    PyBuffer_Release(&comm);
    PyBuffer_Release(&spec);
    return ok ? 0 : -1;
}

PyObject *hfr_py_node_run(PyObject *self, PyObject *args) {
    (void)self;
    hfr_comm c;
    hfr_job j;
    if (unpack(args, "node_run", &c, &j, sizeof j))
        return NULL;
    hfr_where where = {0, 0, 0, 0};
    int rc;
    /* Only the main thread runs Python's signal handlers: there a wait that sleeps looks at them
     * between futex slices, so Ctrl-C stops a collective whose peers never come within 50 ms. */
    interrupt_state is = {NULL};
    int main_thread = PyThread_get_thread_ident() == main_ident();
    is.save = PyEval_SaveThread();
    rc = hfr_node_run(&c, &j, &where, main_thread ? signal_pending : NULL, &is);
    PyEval_RestoreThread(is.save);
    if (rc == HFR_INTERRUPTED) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_KeyboardInterrupt, "hfreduce: interrupted inside a collective");
        return NULL;
    }
    return Py_BuildValue("(iLLLL)", rc, (long long)where.stage, (long long)where.local_rank, (long long)where.chunk,
                         (long long)where.late);
}

/* _core.tree_run(comm: bytes, job: bytes) -> (rc, link, sending, chunk, stage, local_rank, kind, seq,
 * frame_chunk, nbytes, digest): one tree's part of one collective (tree.h), GIL released. */
PyObject *hfr_py_tree_run(PyObject *self, PyObject *args) {
    (void)self;
    hfr_comm c;
    hfr_tree_job j;
    if (unpack(args, "tree_run", &c, &j, sizeof j))
        return NULL;
    hfr_tree_where w;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hfr_tree_run(&c, &j, &w);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iLLLLLLLLLy#)", rc, (long long)w.link, (long long)w.sending, (long long)w.chunk,
                         (long long)w.stage, (long long)w.local_rank, (long long)w.kind, (long long)w.seq,
                         (long long)w.frame_chunk, (long long)w.nbytes, (const char *)w.digest,
                         (Py_ssize_t)sizeof w.digest);
}

/* _core.exchange_drive(items: bytearray, slice_ns, spin_ns) -> (rc, index): the packed hfx_items of one
 * synchronous exchange (exchange.h), moved with the GIL released and their progress written back. */
PyObject *hfr_py_exchange_drive(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer items;
    long long slice_ns, spin_ns;
    if (!PyArg_ParseTuple(args, "w*LL", &items, &slice_ns, &spin_ns))
        return NULL;
    if (items.len <= 0 || items.len % (Py_ssize_t)sizeof(hfx_item) || slice_ns < 0 || spin_ns < 0) {
        PyErr_Format(PyExc_ValueError, "exchange_drive: items must be a whole number (at least 1) of %zd-byte items "
                     "and the times not negative", sizeof(hfx_item));
        PyBuffer_Release(&items);
        return NULL;
    }
    int64_t index = -1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hfx_drive((hfx_item *)items.buf, (int64_t)(items.len / (Py_ssize_t)sizeof(hfx_item)), slice_ns, spin_ns,
                   &index);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&items);
    return Py_BuildValue("(iL)", rc, (long long)index);
}
