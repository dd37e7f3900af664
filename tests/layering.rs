//! Architecture checks over the whole workspace: crates depend only on the floors below them
//! (DESIGN.md's table, read from `cargo metadata`), and every Rust source file opens with a `//!`
//! module doc.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Which workspace crates each crate may depend on (DESIGN.md, "Layout").
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    BTreeMap::from([
        ("rtx-kernels", &[][..]),
        ("rtx-tensor", &["rtx-kernels"][..]),
        ("rtx-collectives", &["rtx-kernels"][..]),
        ("rtx-actors", &["rtx-kernels", "rtx-tensor", "rtx-collectives"][..]),
        ("rtx-pipelines", &["rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors"][..]),
        ("rtx-supervisor", &["rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors", "rtx-pipelines"][..]),
        // Federation sits beside the supervisor: tensor, collectives and actors, never pipelines/supervisor.
        ("rtx-federated", &["rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors"][..]),
        ("rtx-sim", &["rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors", "rtx-pipelines", "rtx-supervisor", "rtx-federated"][..]),
        ("rustytorch", &["rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors", "rtx-pipelines", "rtx-supervisor", "rtx-federated", "rtx-sim"][..]),
        ("rtx-examples", &["rustytorch", "rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors", "rtx-pipelines", "rtx-supervisor", "rtx-federated", "rtx-sim"][..]),
        // The Python package's extension module (python/) sits on top, beside the examples.
        ("rustytorch-python", &["rustytorch", "rtx-kernels", "rtx-tensor", "rtx-collectives", "rtx-actors", "rtx-pipelines", "rtx-supervisor", "rtx-federated", "rtx-sim"][..]),
    ])
}

#[test]
fn crates_depend_only_on_lower_floors() {
    // Goal: a lower floor never imports a higher one. Method: every path dependency (normal,
    // dev or build) of every workspace member must be in that member's allowed list.
    let out = Command::new(env!("CARGO")).args(["metadata", "--format-version", "1", "--no-deps", "--offline"]).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let allowed = allowed();
    let members: Vec<&str> = meta["packages"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    let mut violations = Vec::new();
    for pkg in meta["packages"].as_array().unwrap() {
        let name = pkg["name"].as_str().unwrap();
        let Some(ok) = allowed.get(name) else {
            violations.push(format!("{name} is not in the floor table of tests/layering.rs (add it where DESIGN.md puts it)"));
            continue;
        };
        for dep in pkg["dependencies"].as_array().unwrap() {
            let dep_name = dep["name"].as_str().unwrap();
            if members.contains(&dep_name) && !ok.contains(&dep_name) {
                violations.push(format!("{name} depends on {dep_name}, which is not below it"));
            }
        }
    }
    assert!(violations.is_empty(), "layering violations:\n{}", violations.join("\n"));
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if !matches!(name, "target" | "data" | "runs" | "fixtures" | ".git") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_source_file_has_a_module_doc() {
    // Goal: every module says what it is for (STYLE.md §2). Method: the first non-blank line of
    // each .rs file under a crate's src/ starts with `//!` (or an inner attribute before it).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "kernels/src", "tensor/src", "collectives/src", "actors/src", "pipelines/src", "supervisor/src", "sim/src", "python/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    let missing: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let first = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with("#![")).unwrap_or("");
            !first.starts_with("//!")
        })
        .map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string())
        .collect();
    assert!(missing.is_empty(), "files without a //! module doc:\n{}", missing.join("\n"));
}
