/* The Python door to hfr_node_run: _core.node_run(comm: bytes, job: bytes) -> (rc, stage, local_rank, chunk, late).
 *
 * comm and job are the int64 fields of hfr_comm and hfr_job (node.h) packed in order. The GIL is
 * released for the whole run, so the engine's other threads (the trees) go on meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "node.h"

PyObject *hfr_py_node_run(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer comm, job;
    if (!PyArg_ParseTuple(args, "y*y*", &comm, &job))
        return NULL;
    if (comm.len != (Py_ssize_t)sizeof(hfr_comm) || job.len != (Py_ssize_t)sizeof(hfr_job)) {
        PyErr_Format(PyExc_ValueError, "node_run: comm must be %zd bytes and job %zd, got %zd and %zd",
                     sizeof(hfr_comm), sizeof(hfr_job), comm.len, job.len);
        PyBuffer_Release(&comm);
        PyBuffer_Release(&job);
        return NULL;
    }
    hfr_comm c;
    hfr_job j;
    memcpy(&c, comm.buf, sizeof c);
    memcpy(&j, job.buf, sizeof j);
    PyBuffer_Release(&comm);
    PyBuffer_Release(&job);
    hfr_where where = {0, 0, 0, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hfr_node_run(&c, &j, &where);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iLLLL)", rc, (long long)where.stage, (long long)where.local_rank, (long long)where.chunk,
                         (long long)where.late);
}
