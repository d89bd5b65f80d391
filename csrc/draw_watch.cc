// Python binding torch_xla_ext._watch: refuses, on one thread, calls into
// host random generators before they draw.
//
// scan traces a step function once where the Python loop would run it each
// iteration; a host random draw inside it would be baked into the loop as
// one constant. Python's random generators are C objects: every draw,
// however it is spelled (random.random, random.shuffle, Random.gauss, ...),
// ends in a call of a C method bound to a generator instance (random,
// getrandbits), which a profile function sees as a c_call event before the
// method runs. (numpy's methods are compiled without such events; the
// Python side handles numpy's global state another way.)
//
// A DrawWatch installs such a profile function with PyEval_SetProfile, which
// sets it for the calling thread only: other threads (a data loader that
// shuffles and augments) keep drawing, unwatched and unrefused. On a call
// whose bound instance is of one of the watched types (and whose method is
// not one that only reads or sets the state), the profile function records
// the hit and fails the call with the given exception before the method
// runs, so nothing is drawn. Calls made while an import runs on the thread
// (a module drawing at import time) are let through. A profile function the
// thread already had (a profiler) is called on after ours.

#include <Python.h>
#include <frameobject.h>
#include <pybind11/pybind11.h>

#include <cstring>

namespace py = pybind11;

namespace {

// Methods of the generators that read, set or describe the state without
// drawing from it.
bool IsNotADraw(const char* name) {
  static const char* const kNames[] = {
      "getstate", "setstate", "get_state", "set_state", "seed", "__reduce__", "__reduce_ex__",
      "__getstate__", "__setstate__", "__repr__", "__str__", "__sizeof__", "__copy__", "__deepcopy__",
  };
  for (const char* known : kNames) {
    if (std::strcmp(name, known) == 0) return true;
  }
  return false;
}

// Whether an import is running on the thread of `frame` (its frames or its
// callers' are importlib's).
bool InImport(PyFrameObject* frame) {
  PyFrameObject* f = frame;
  Py_XINCREF(f);
  bool found = false;
  while (f != nullptr && !found) {
    PyCodeObject* code = PyFrame_GetCode(f);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    found = file != nullptr && std::strncmp(file, "<frozen importlib._bootstrap", 28) == 0;
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  PyErr_Clear();  // PyUnicode_AsUTF8 of an odd file name
  return found;
}

class DrawWatch {
 public:
  DrawWatch(py::tuple types, py::object error) : types_(std::move(types)), error_(std::move(error)) {
    for (const py::handle& t : types_) {
      if (!PyType_Check(t.ptr())) throw py::type_error("DrawWatch: types must be a tuple of types");
    }
    if (!PyExceptionClass_Check(error_.ptr())) throw py::type_error("DrawWatch: error must be an exception type");
  }

  void Enter() {
    if (active_) throw py::value_error("DrawWatch: already watching");
    tstate_ = PyThreadState_Get();
    prev_func_ = tstate_->c_profilefunc;
    prev_obj_ = tstate_->c_profileobj;
    Py_XINCREF(prev_obj_);  // PyEval_SetProfile drops the thread's reference to it
    capsule_ = py::capsule(static_cast<void*>(this));
    PyEval_SetProfile(&DrawWatch::Profile, capsule_.ptr());
    active_ = true;
  }

  void Exit() {
    if (!active_) return;
    if (PyThreadState_Get() != tstate_) throw py::value_error("DrawWatch: left on another thread than entered");
    PyEval_SetProfile(prev_func_, prev_obj_);
    Py_XDECREF(prev_obj_);
    prev_obj_ = nullptr;
    active_ = false;
  }

  // The first refused call: (generator instance, method name), or None.
  py::object Hit() const { return hit_ ? py::make_tuple(hit_self_, hit_name_) : py::object(py::none()); }

 private:
  static int Profile(PyObject* obj, PyFrameObject* frame, int what, PyObject* arg) {
    auto* self = static_cast<DrawWatch*>(PyCapsule_GetPointer(obj, nullptr));
    if (self == nullptr) return -1;
    if (what == PyTrace_C_CALL && PyCFunction_Check(arg)) {
      PyObject* owner = PyCFunction_GET_SELF(arg);
      if (owner != nullptr && self->IsGenerator(owner)) {
        const char* name = reinterpret_cast<PyCFunctionObject*>(arg)->m_ml->ml_name;
        if (!IsNotADraw(name) && !InImport(frame)) return self->Refuse(owner, name);
      }
    }
    return self->prev_func_ != nullptr ? self->prev_func_(self->prev_obj_, frame, what, arg) : 0;
  }

  bool IsGenerator(PyObject* owner) const {
    for (const py::handle& t : types_) {
      if (PyObject_TypeCheck(owner, reinterpret_cast<PyTypeObject*>(t.ptr()))) return true;
    }
    return false;
  }

  int Refuse(PyObject* owner, const char* name) {
    if (!hit_) {
      hit_ = true;
      hit_self_ = py::reinterpret_borrow<py::object>(owner);
      hit_name_ = py::str(name);
    }
    PyObject* args = Py_BuildValue("(Os)", owner, name);
    if (args != nullptr) {
      PyErr_SetObject(error_.ptr(), args);
      Py_DECREF(args);
    }
    return -1;  // the call is not made; the exception propagates from it
  }

  py::tuple types_;
  py::object error_;
  py::capsule capsule_;
  PyThreadState* tstate_ = nullptr;
  Py_tracefunc prev_func_ = nullptr;
  PyObject* prev_obj_ = nullptr;
  bool active_ = false;
  bool hit_ = false;
  py::object hit_self_;
  py::object hit_name_;
};

}  // namespace

PYBIND11_MODULE(_watch, m) {
  m.doc() = "Per-thread refusal of host random draws (see csrc/draw_watch.cc).";
  py::class_<DrawWatch>(m, "DrawWatch")
      .def(py::init<py::tuple, py::object>(), py::arg("types"), py::arg("error"))
      .def("__enter__", [](DrawWatch& w) { w.Enter(); })
      .def("__exit__", [](DrawWatch& w, py::args) { w.Exit(); return false; })
      .def("hit", &DrawWatch::Hit);
}
