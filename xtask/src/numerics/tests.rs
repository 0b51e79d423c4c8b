//! Unit tests of the numerics table and its check.

use super::table::Record;
use super::*;

fn recs(rows: &[(&str, f64, f64, bool)]) -> Records {
    rows.iter()
        .map(|&(t, err, bound, loss)| {
            (
                (t.to_string(), "case".to_string()),
                Record { err, bound, loss },
            )
        })
        .collect()
}

#[test]
fn a_margin_under_four_or_a_lossy_error_the_kernels_move_fails() {
    let other = Setting {
        mkl: Some("AVX2"),
        aten: None,
    };
    let all = [
        (
            BASELINE,
            recs(&[
                ("wide", 1e-6, 1e-4, false),
                ("tight", 1e-5, 1e-4, false),
                ("steady", 0.5, 1.0, true),
                ("moved", 0.5, 1.0, true),
            ]),
        ),
        (
            other,
            recs(&[
                ("wide", 2e-6, 1e-4, false),
                ("tight", 3e-5, 1e-4, false),
                ("steady", 0.5001, 1.0, true),
                ("moved", 0.7, 1.0, true),
            ]),
        ),
    ];
    let (text, over) = table(&all);
    assert_eq!(over.len(), 2, "{over:?}");
    assert!(
        over[0].starts_with("moved") && over[1].starts_with("tight"),
        "{over:?}"
    );
    assert!(
        text.contains("| `wide` | case | order | 1.0e-4 | 2.00e-6 | MKL_CBWR=AVX2"),
        "{text}"
    );
}

#[test]
fn logs_are_read_as_the_worst_per_case_and_bad_lines_refused() {
    let dir = std::env::temp_dir().join(format!("xtask-numerics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("log.tsv");
    std::fs::write(
        &p,
        "t\tc\t1e-6\t1e-4\torder\nt\tc\t3e-6\t1e-4\torder\nt\tc\t2e-6\t1e-4\torder\n",
    )
    .unwrap();
    let r = read_log(&p).unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[&("t".into(), "c".into())].err, 3e-6);
    std::fs::write(&p, "t\tc\t1e-6\n").unwrap();
    assert!(read_log(&p).is_err());
    assert!(read_log(&dir.join("absent")).unwrap().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}
