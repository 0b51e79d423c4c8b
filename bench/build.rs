//! The engine's link setup (rpath to libtorch, `libtorch_cuda` kept), shared
//! so this crate's binaries that use the engine start without
//! `LD_LIBRARY_PATH`.

include!("../engine/link_libtorch.rs.in");
