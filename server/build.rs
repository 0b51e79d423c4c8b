//! The engine's link setup (rpath to libtorch, `libtorch_cuda` kept), shared
//! so that `kvforge-serve` and this crate's tests start without
//! `LD_LIBRARY_PATH`.

include!("../engine/link_libtorch.rs.in");
