//! Untrusted model files: copies of the SmolLM2 GGUF with one field changed
//! each, as a user's download might be. Every one is a one-line error, never
//! an abort, a panic or garbage weights.

use kvforge_engine::{Engine, EngineConfig};

use super::{model_path, one_line, temp};

/// Where things are in a GGUF file: each metadata value (after its type),
/// each tensor-info entry's type id and offset fields.
struct Map {
    /// key -> (type id offset, value offset)
    meta: Vec<(String, usize, usize)>,
    /// name -> (type field offset, offset field offset)
    tensors: Vec<(String, usize, usize)>,
}

fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], p: usize) -> u64 {
    u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
}

/// Bytes of a value of type `ty` at `p` (arrays included).
fn value_len(b: &[u8], ty: u32, p: usize) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8 + u64_at(b, p) as usize,
        9 => {
            let inner = u32_at(b, p);
            let n = u64_at(b, p + 4) as usize;
            let mut q = p + 12;
            for _ in 0..n {
                q += value_len(b, inner, q);
            }
            q - p
        }
        t => panic!("type {t}"),
    }
}

fn map(b: &[u8]) -> Map {
    let n_tensors = u64_at(b, 8) as usize;
    let n_kv = u64_at(b, 16) as usize;
    let mut p = 24;
    let string = |p: &mut usize| {
        let n = u64_at(b, *p) as usize;
        let s = String::from_utf8(b[*p + 8..*p + 8 + n].to_vec()).unwrap();
        *p += 8 + n;
        s
    };
    let mut meta = Vec::new();
    for _ in 0..n_kv {
        let key = string(&mut p);
        let ty = u32_at(b, p);
        meta.push((key, p, p + 4));
        p += 4 + value_len(b, ty, p + 4);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = string(&mut p);
        let dims = u32_at(b, p) as usize;
        p += 4 + 8 * dims;
        tensors.push((name, p, p + 4));
        p += 12;
    }
    Map { meta, tensors }
}

fn meta_at(m: &Map, key: &str) -> (usize, usize) {
    let (_, t, v) = m.meta.iter().find(|(k, _, _)| k == key).unwrap();
    (*t, *v)
}

fn tensor_at(m: &Map, name: &str) -> (usize, usize) {
    let (_, t, o) = m.tensors.iter().find(|(n, _, _)| n == name).unwrap();
    (*t, *o)
}

/// Loads `bytes` as a model; returns the one-line error.
fn refused(bytes: &[u8], name: &str) -> String {
    let p = temp(name, bytes);
    match Engine::load(&p, &EngineConfig::default()) {
        Ok(_) => panic!("{name} loaded"),
        Err(e) => one_line(&e),
    }
}

fn model() -> (Vec<u8>, Map) {
    let b = std::fs::read(model_path()).unwrap();
    let m = map(&b);
    (b, m)
}

#[test]
fn absurd_hyperparameters_are_refused_before_allocating() {
    let (orig, m) = model();
    for (key, value, needle) in [
        ("llama.block_count", u32::MAX, "layer count 4294967295"),
        ("llama.context_length", 1 << 31, "context length 2147483648"),
        ("llama.embedding_length", u32::MAX, "hidden size"),
        ("llama.feed_forward_length", u32::MAX, "feed-forward size"),
    ] {
        let (t, v) = meta_at(&m, key);
        assert_eq!(u32_at(&orig, t), 4, "{key} is a u32");
        let mut b = orig.clone();
        b[v..v + 4].copy_from_slice(&value.to_le_bytes());
        let e = refused(&b, "absurd.gguf");
        assert!(e.contains(needle), "{key}: {e}");
    }
}

#[test]
fn non_finite_or_non_positive_rope_base_and_epsilon_are_refused() {
    let (orig, m) = model();
    for key in [
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
    ] {
        let (t, v) = meta_at(&m, key);
        assert_eq!(u32_at(&orig, t), 6, "{key} is an f32");
        for bad in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
            let mut b = orig.clone();
            b[v..v + 4].copy_from_slice(&bad.to_le_bytes());
            let e = refused(&b, "rope.gguf");
            assert!(e.contains("must be finite"), "{key} = {bad}: {e}");
        }
    }
}

#[test]
fn a_layer_count_that_does_not_match_the_tensors_is_refused() {
    let (orig, m) = model();
    let (_, v) = meta_at(&m, "llama.block_count");
    let mut b = orig.clone();
    b[v..v + 4].copy_from_slice(&1u32.to_le_bytes());
    let e = refused(&b, "one-layer.gguf");
    assert!(e.contains("does not belong to a 1-layer LLaMA"), "{e}");
    let mut b = orig;
    b[v..v + 4].copy_from_slice(&31u32.to_le_bytes());
    let e = refused(&b, "31-layers.gguf");
    assert!(e.contains("blk.30.") && e.contains("missing"), "{e}");
}

#[test]
fn moved_unaligned_overlapping_or_retyped_tensor_data_is_refused() {
    let (orig, m) = model();
    let (ty, off) = tensor_at(&m, "blk.3.attn_q.weight");
    let at = u64_at(&orig, off);
    for (delta, needle) in [
        (1u64, "not aligned"),
        (32, "gap"),
        (u64::MAX - 31, "overlaps"),
    ] {
        let mut b = orig.clone();
        b[off..off + 8].copy_from_slice(&at.wrapping_add(delta).to_le_bytes());
        let e = refused(&b, "moved.gguf");
        assert!(e.contains(needle), "{delta}: {e}");
    }
    // Q4_1 (20 bytes per 32) swapped for Q4_0 (18) or Q8_0 (34): the data
    // no longer tiles.
    assert_eq!(u32_at(&orig, ty), 3, "the weights are Q4_1");
    for other in [2u32, 8] {
        let mut b = orig.clone();
        b[ty..ty + 4].copy_from_slice(&other.to_le_bytes());
        let e = refused(&b, "retyped.gguf");
        assert!(
            e.contains("its offset or type is wrong"),
            "type {other}: {e}"
        );
    }
}

#[test]
fn bad_tokenizer_metadata_is_refused() {
    let (orig, m) = model();
    // The token-type array's elements retyped from i32 to f32.
    let (_, v) = meta_at(&m, "tokenizer.ggml.token_type");
    assert_eq!(u32_at(&orig, v), 5, "token types are i32");
    let mut b = orig.clone();
    b[v..v + 4].copy_from_slice(&6u32.to_le_bytes());
    let e = refused(&b, "token-type.gguf");
    assert!(e.contains("not an array of integers"), "{e}");
    // Special token ids outside the vocabulary.
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
        let (t, v) = meta_at(&m, key);
        assert_eq!(u32_at(&orig, t), 4, "{key} is a u32");
        let mut b = orig.clone();
        b[v..v + 4].copy_from_slice(&49_152u32.to_le_bytes());
        let e = refused(&b, "token-id.gguf");
        assert!(e.contains(key) && e.contains("below the vocabulary"), "{e}");
    }
}
