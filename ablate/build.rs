//! The engine's link setup (rpath to libtorch, `libtorch_cuda` kept), so
//! this crate's test binaries start without `LD_LIBRARY_PATH`.

include!("../engine/link_libtorch.rs.in");
