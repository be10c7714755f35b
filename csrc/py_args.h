/*
** py_args.h: the argument readers of eager.cpp's CPython entries
** (METH_FASTCALL functions): a tensor, an optional tensor, a list of ints, a
** bool, a float, each checked as it is read, with a TypeError that names the entry and
** the argument.
**
** Why not pybind11's casters: they build a caster object per argument (torch's
** int-list caster fills a std::vector through its own element checks), and
** on a slow host that adds up.  A do-nothing function with
** conv_fwd's 11 arguments took 5.4 us a call on the H200 machine's host
** against 1.4 us for the same function reading them here (session 66,
** interleaved in one process), 2.8 against 0.8 on a 2-core x86 host: the
** largest part of the op call's host time before its launch but the launch
** itself.  These readers take a tensor as THPVariable_Unpack does and an int
** with PyLong_AsLongLongAndOverflow.
**
** Each returns false with the Python error set; the entry then returns NULL.
** A tensor is borrowed from its argument, which the caller holds for the call.
*/
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>

namespace torchsp {

/* An int-list argument: algo lists hold 4 values, segment lists 4 per segment. */
using PyInts = c10::SmallVector<int64_t, 8>;

/* True when the entry `fn` got `want` arguments, else a TypeError. */
inline bool py_nargs(Py_ssize_t got, Py_ssize_t want, const char *fn) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s: takes %zd positional arguments, got %zd", fn, want, got);
  return false;
}

/* *out = the tensor `o` (a torch.Tensor or subclass), or a TypeError naming `name`. */
inline bool py_tensor(PyObject *o, const char *fn, const char *name, const at::Tensor **out) {
  if (THPVariable_Check(o)) {
    *out = &THPVariable_Unpack(o);
    return true;
  }
  PyErr_Format(PyExc_TypeError, "%s: %s must be a Tensor, got %s", fn, name, Py_TYPE(o)->tp_name);
  return false;
}

/* *out = the tensor `o`, or nullopt for None. */
inline bool py_opt_tensor(PyObject *o, const char *fn, const char *name, std::optional<at::Tensor> *out) {
  if (o == Py_None) {
    out->reset();
    return true;
  }
  const at::Tensor *t = nullptr;
  if (!py_tensor(o, fn, name, &t)) return false;
  *out = *t;
  return true;
}

/* *out = the values of a list or tuple of Python ints `o` (bools count, as
** for pybind11's list caster); a TypeError for anything else, an
** OverflowError for a value outside int64. */
inline bool py_ints(PyObject *o, const char *fn, const char *name, PyInts *out) {
  const bool tuple = PyTuple_Check(o);
  if (!tuple && !PyList_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a list of ints, got %s", fn, name, Py_TYPE(o)->tp_name);
    return false;
  }
  const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *e = tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
    if (!PyLong_Check(e)) {
      PyErr_Format(PyExc_TypeError, "%s: %s[%zd] must be an int, got %s", fn, name, i, Py_TYPE(e)->tp_name);
      return false;
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(e, &overflow);
    if (overflow != 0) {
      PyErr_Format(PyExc_OverflowError, "%s: %s[%zd] does not fit in int64", fn, name, i);
      return false;
    }
    if (v == -1 && PyErr_Occurred()) return false;
    (*out)[static_cast<size_t>(i)] = static_cast<int64_t>(v);
  }
  return true;
}

/* *out = the Python bool `o` (True or False only). */
inline bool py_bool(PyObject *o, const char *fn, const char *name, bool *out) {
  if (PyBool_Check(o)) {
    *out = o == Py_True;
    return true;
  }
  PyErr_Format(PyExc_TypeError, "%s: %s must be a bool, got %s", fn, name, Py_TYPE(o)->tp_name);
  return false;
}

/* *out = the Python float or int `o` (a bool is refused, as an accident). */
inline bool py_double(PyObject *o, const char *fn, const char *name, double *out) {
  if ((PyFloat_Check(o) || PyLong_Check(o)) && !PyBool_Check(o)) {
    *out = PyFloat_AsDouble(o);
    return !(*out == -1.0 && PyErr_Occurred());
  }
  PyErr_Format(PyExc_TypeError, "%s: %s must be a float, got %s", fn, name, Py_TYPE(o)->tp_name);
  return false;
}

}  // namespace torchsp
