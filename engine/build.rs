//! Makes the `kvforge` binaries and tests find libtorch at run time (rpath to
//! the directory torch-sys linked against) and keeps `libtorch_cuda` linked
//! even though nothing references it by symbol, so CUDA is visible when the
//! GPU build of torch is installed. Shared with `bench/build.rs`.

include!("link_libtorch.rs.in");
