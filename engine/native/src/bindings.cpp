// Python bindings of the native core. The GIL is released around every read.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "direct_file.hpp"

namespace nb = nanobind;
using ByteArray = nb::ndarray<std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

NB_MODULE(_core, m) {
  m.doc() = "TokenWing native core: direct-I/O reads (the streaming core grows here)";
  m.attr("DIRECT_ALIGNMENT") = tw::kDirectAlignment;
  nb::exception<tw::IoError>(m, "IoError", PyExc_OSError);

  nb::class_<tw::DirectFile>(m, "DirectFile")
      .def(nb::init<const std::string&, bool>(), nb::arg("path"), nb::arg("direct") = true)
      .def_prop_ro("direct", &tw::DirectFile::direct)
      .def_prop_ro("size", &tw::DirectFile::size)
      .def_prop_ro("path", &tw::DirectFile::path)
      .def_prop_ro("fallback_reason", &tw::DirectFile::fallback_reason)
      .def(
          "read_into",
          [](const tw::DirectFile& f, std::uint64_t offset, ByteArray dst) {
            std::uint8_t* ptr = dst.data();
            std::size_t len = dst.shape(0);
            nb::gil_scoped_release release;
            f.read_exact(offset, ptr, len);
          },
          nb::arg("offset"), nb::arg("dst"),
          "Fill the whole writable uint8 array `dst` from `offset` (aligned when direct).")
      .def("close", &tw::DirectFile::close)
      .def("__enter__", [](tw::DirectFile& f) -> tw::DirectFile& { return f; }, nb::rv_policy::reference)
      .def("__exit__", [](tw::DirectFile& f, nb::args) { f.close(); });
}
