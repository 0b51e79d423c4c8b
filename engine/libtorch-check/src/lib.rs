//! Nothing at run time: this crate exists for its build script, which checks
//! that libtorch is installed before `torch-sys` tries to compile against it.
