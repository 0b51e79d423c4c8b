//! Unit tests of the hygiene rules, on small trees written for each.

#[test]
fn a_safe_target_feature_fn_is_found() {
    let attr = ["#[", "target_feature(enable = \"avx2\")]"].concat();
    let safe = format!("//! x\n{attr}\nfn f() {{}}\n");
    assert_eq!(super::safe_target_feature_fn(&safe), Some(2));
    let unsafe_fn = format!("//! x\n{attr}\n#[inline]\nunsafe fn f() {{}}\n");
    assert_eq!(super::safe_target_feature_fn(&unsafe_fn), None);
    assert_eq!(super::msrv_minor("rust-version = \"1.85\""), Some(85));
}

/// A crate that breaks each module rule once: a re-export imported
/// through the root, a circle of modules, a circle of files through
/// `super::`, a re-export named on the second line of a `use`; and what
/// the rules allow (an item the root defines, an `unsafe fn` too, a module
/// named through `crate::`).
#[test]
fn circles_and_root_re_exports_are_found_and_the_allowed_forms_pass() {
    let root = std::env::temp_dir().join(format!("kvforge-tidy-{}", std::process::id()));
    let src = root.join("k/src");
    let write = |p: &str, text: &str| {
        let p = src.join(p);
        std::fs::create_dir_all(p.parent().expect("a parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    };
    write(
        "lib.rs",
        "//! k\nmod a;\nmod b;\nmod c;\nmod m;\npub use a::X;\npub struct Y;\npub(crate) unsafe fn u() {}\n",
    );
    write(
        "a.rs",
        "//! a\nuse crate::Y;\nuse crate::b::Z;\npub struct X;\n",
    );
    write("b.rs", "//! b\nuse crate::{a::X, X as W};\npub struct Z;\n");
    write("c.rs", "//! c\nuse crate::{\n    u,\n    X,\n};\n");
    write("m/mod.rs", "//! m\nmod p;\nmod q;\nmod r;\n");
    write("m/p.rs", "//! p\nuse super::q::Q;\n");
    write("m/q.rs", "//! q\nuse super::{r::R, p};\npub struct Q;\n");
    write("m/r.rs", "//! r\nuse super::super::Y;\npub struct R;\n");
    let mut got = super::module_graph_problems(&root, "k/src").expect("graph");
    got.extend(super::sibling_circles(&root, &src.join("m")).expect("siblings"));
    std::fs::remove_dir_all(&root).expect("clean up");
    let want = [
        "k/src/b.rs: `crate::X` is a re-export of the crate root; import it from its module",
        "k/src/c.rs: `crate::X` is a re-export of the crate root; import it from its module",
        "k/src: modules import each other in a circle: a -> b -> a",
        "k/src: modules import each other in a circle: b -> a -> b",
        "k/src/m: files import each other through super:: in a circle: p -> q -> p",
        "k/src/m: files import each other through super:: in a circle: q -> p -> q",
    ];
    assert_eq!(got, want);
}

/// A crate's source file over 400 lines, or a function over 100, is
/// found anywhere below a `src` folder; tests and files outside `src` are
/// not measured.
#[test]
fn lengths_are_measured_in_every_crates_sources_only() {
    let long_file = format!("//! x\n{}", "const A: u8 = 0;\n".repeat(400));
    let long_fn = format!("//! x\nfn f() {{\n{}}}\n", "    g();\n".repeat(100));
    let got = |rel: &str, text: &str| super::length_problems(rel, text);
    assert_eq!(got("any/crate/src/a.rs", &long_file).len(), 1);
    assert_eq!(
        got("k/src/a.rs", &long_fn),
        ["k/src/a.rs:2: fn f has 102 lines (at most 100)"]
    );
    assert!(got("k/src/m/tests.rs", &long_file).is_empty());
    assert!(got("k/tests/a.rs", &long_file).is_empty());
    assert!(got("k/benches/a.rs", &long_fn).is_empty());
    let with_tests = format!(
        "//! x\nconst A: u8 = 0;\n#[cfg(test)]\nmod tests {{\n{}}}\n",
        "const B: u8 = 0;\n".repeat(400)
    );
    assert!(got("k/src/a.rs", &with_tests).is_empty());
}

#[test]
fn the_tree_is_tidy() {
    let problems = super::check(&crate::project_root()).expect("walk the tree");
    assert!(
        problems.is_empty(),
        "tidy problems:\n{}",
        problems.join("\n")
    );
}
