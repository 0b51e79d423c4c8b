// Found only when libtorch is missing: the real torch/torch.h under
// .venv/libtorch/include comes first on the include path once it exists.
#error "libtorch not found at .venv/libtorch: run `cargo xtask setup` first (it installs torch 2.11.0 into .venv)"
