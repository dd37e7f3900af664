//! Source hygiene of this crate: every module opens with a `//!` doc paragraph, and library code
//! has no `unwrap()`/`expect(` outside its `#[cfg(test)]` modules.
#![allow(clippy::unwrap_used)]

use std::path::Path;

fn sources() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "expected the crate's modules, found {}", files.len());
    files
}

// Goal: each module says what it is for in its first line.
#[test]
fn every_module_has_a_doc_paragraph() {
    for (name, text) in sources() {
        assert!(text.starts_with("//! "), "{name} does not start with a //! doc paragraph");
    }
}

// Goal: library code returns errors instead of panicking on `unwrap`/`expect`.
#[test]
fn no_unwrap_outside_tests() {
    for (name, text) in sources() {
        let library = text.split("#[cfg(test)]").next().unwrap();
        for (i, line) in library.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            assert!(!code.contains(".unwrap()") && !code.contains(".expect("), "{name}:{}: unwrap/expect in library code: {line}", i + 1);
        }
    }
}
