/* Native pread thread pool (minimal placeholder; the full pool lands with the I/O engine issue). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pread_pool", NULL, -1, methods};
PyMODINIT_FUNC PyInit__pread_pool(void) { return PyModule_Create(&module); }
