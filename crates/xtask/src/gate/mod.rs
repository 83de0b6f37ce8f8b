//! `cargo xtask gate`: the link check and its self-test, the mutation suite.
//!
//! The link check links every target of the workspace (binaries, tests,
//! benches, examples) in the release profile with `cuda,xla-iree`, running
//! none. The mutation suite proves the check would catch link-only
//! regressions: for each mutation, on a copy of the tree (and of the prefix),
//! `cargo check` must still pass and the link check must fail with the
//! expected text. Every run shares the checkout's own target folder (under
//! Nix, the one crane filled with the dependency artifacts), so neither the
//! link check nor the mutants compile a dependency again; the mutated tree
//! lives outside the checkout, where cargo reads no second
//! `.cargo/config.toml` (two would repeat the rustflags, and new rustflags
//! mean every dependency recompiled).

mod mutations;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use serde::Serialize;

use crate::pins::repo_root;
use crate::target::Target;
use mutations::{Edit, LibsEdit, MUTATIONS, Mutation};

const FEATURES: &str = "cuda,xla-iree";

#[derive(Serialize)]
struct Line {
    name: String,
    /// What the line checks (for a mutation: the regression it models).
    models: String,
    verdict: &'static str,
    seconds: f64,
    detail: String,
}

/// One gate run: the prefix it links against and the target it links for
/// (a cross target is linked by its GNU toolchain, as on the machine itself).
struct Build<'a> {
    prefix: &'a Path,
    target: &'a Target,
    target_dir: &'a Path,
}

/// Runs the link check and, unless `link_only`, the mutation suite; prints the
/// report and writes it as JSON. Fails if any line failed.
pub fn run(prefix: &Path, target: &Target, link_only: bool, only: Option<&str>) -> Result<()> {
    let root = repo_root();
    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        // Relative to where cargo runs, as cargo reads it (crane sets `target`).
        Some(dir) => std::env::current_dir()?.join(dir),
        None => root.join("target"),
    };
    let work = target_dir.join("gate");
    std::fs::create_dir_all(&work)?;
    let scratch = scratch_folder()?;
    // Every target shares the one target folder: cargo keeps each target's
    // artifacts apart inside it (`target/TRIPLE/`), and the build scripts
    // and proc macros, built for the host, are shared.
    let build = Build {
        prefix,
        target,
        target_dir: &target_dir,
    };
    let mut report: Vec<Line> = Vec::new();

    let started = Instant::now();
    let link = link_check(&root, &build, prefix)?;
    let ok = link.success;
    report.push(Line {
        name: "link-check".into(),
        models: format!(
            "every release cuda,xla-iree target links for {}",
            target.triple
        ),
        verdict: if ok { "PASS" } else { "FAIL" },
        seconds: started.elapsed().as_secs_f64(),
        detail: if ok {
            "every target linked".into()
        } else {
            first_error_line(&link.output)
        },
    });
    print_line(report.last().expect("just pushed"));
    if !ok {
        eprintln!("{}", tail(&link.output, 40));
    }

    if ok && !link_only {
        for mutation in MUTATIONS
            .iter()
            .filter(|m| only.is_none_or(|o| o == m.name))
        {
            let line = run_mutation(mutation, &root, &build, scratch.path(), &work)?;
            print_line(&line);
            report.push(line);
        }
    }

    let failed = report
        .iter()
        .filter(|l| !matches!(l.verdict, "PASS" | "CAUGHT" | "SKIPPED"))
        .count();
    let passed = report.iter().filter(|l| l.verdict != "SKIPPED").count() - failed;
    let json = work.join(format!("report-{}.json", target.triple));
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)?;
    println!(
        "gate: {passed} passed, {failed} failed (report: {})",
        json.display()
    );
    if failed > 0 {
        return Err(anyhow!(
            "the gate failed: {failed} line(s) above are not PASS/CAUGHT"
        ));
    }
    Ok(())
}

/// Where the mutants are made: outside the checkout, in the system's
/// temporary folder.
fn scratch_folder() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("kiln-gate-")
        .tempdir()
        .context("cannot create a scratch folder for the mutants")
}

struct Outcome {
    success: bool,
    output: String,
}

/// `cargo test --release --features cuda,xla-iree --workspace --all-targets
/// --no-run --locked [--target T]`, RUSTFLAGS untouched. `prefix` is the
/// build's prefix or a mutant's copy of it.
fn link_check(tree: &Path, build: &Build, prefix: &Path) -> Result<Outcome> {
    cargo(
        tree,
        build,
        prefix,
        &[
            "test",
            "--release",
            "--features",
            FEATURES,
            "--workspace",
            "--all-targets",
            "--no-run",
            "--locked",
        ],
    )
}

fn check(tree: &Path, build: &Build, prefix: &Path) -> Result<Outcome> {
    cargo(
        tree,
        build,
        prefix,
        &[
            "check",
            "--features",
            FEATURES,
            "--workspace",
            "--all-targets",
            "--locked",
        ],
    )
}

fn cargo(tree: &Path, build: &Build, prefix: &Path, args: &[&str]) -> Result<Outcome> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(args);
    if build.target.cross {
        // Its linker (the cross gcc, GNU ld) is the tree's .cargo/config.toml's.
        command.args(["--target", build.target.triple]);
    }
    let output = command
        .current_dir(tree)
        .env("KILN_IREE_PREFIX", prefix)
        .env("CARGO_TARGET_DIR", build.target_dir)
        .env("CARGO_TERM_COLOR", "never")
        .output()
        .context("cannot run cargo")?;
    Ok(Outcome {
        success: output.status.success(),
        output: String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr),
    })
}

fn run_mutation(
    mutation: &Mutation,
    root: &Path,
    build: &Build,
    scratch: &Path,
    work: &Path,
) -> Result<Line> {
    let line = |verdict, seconds, detail: String| Line {
        name: mutation.name.into(),
        models: mutation.models.into(),
        verdict,
        seconds,
        detail,
    };
    if let Some(arch) = mutation.only_arch
        && arch != build.target.arch()
    {
        return Ok(line(
            "SKIPPED",
            0.0,
            format!("{arch} only (run `cargo xtask gate --target {arch}-unknown-linux-gnu`)"),
        ));
    }
    let started = Instant::now();
    // The same paths every time: cargo's fingerprints of the workspace crates
    // then differ only where the mutation edits.
    let tree = scratch.join("tree");
    let mutant_prefix = scratch.join("prefix");
    crate::tree::copy_checkout(root, &tree)?;
    copy_dir(build.prefix, &mutant_prefix)?;
    if let Err(error) = apply(mutation.edits, &tree, &mutant_prefix) {
        return Ok(line(
            "BROKEN",
            started.elapsed().as_secs_f64(),
            format!("{error:#}"),
        ));
    }
    let checked = check(&tree, build, &mutant_prefix)?;
    let verdict = if !checked.success {
        line("NOT LINK-ONLY", 0.0, first_error_line(&checked.output))
    } else {
        let linked = link_check(&tree, build, &mutant_prefix)?;
        let logs = work.join("logs");
        std::fs::create_dir_all(&logs)?;
        std::fs::write(
            logs.join(format!("{}-{}.log", build.target.triple, mutation.name)),
            &linked.output,
        )?;
        if linked.success {
            line(
                "SURVIVED",
                0.0,
                "the link check passed on the mutant".into(),
            )
        } else if let Some(hit) = linked
            .output
            .lines()
            .find(|l| l.contains("undefined") && l.contains(mutation.expect))
        {
            line("CAUGHT", 0.0, hit.trim().to_string())
        } else {
            line(
                "WRONG FAILURE",
                0.0,
                format!(
                    "expected `{}` undefined; got: {}",
                    mutation.expect,
                    first_error_line(&linked.output)
                ),
            )
        }
    };
    std::fs::remove_dir_all(&tree).ok();
    std::fs::remove_dir_all(&mutant_prefix).ok();
    Ok(Line {
        seconds: started.elapsed().as_secs_f64(),
        ..verdict
    })
}

fn apply(edits: &[Edit], tree: &Path, prefix: &Path) -> Result<()> {
    for edit in edits {
        match edit {
            Edit::Tree { file, from, to } => {
                let file = tree.join(file);
                let text = std::fs::read_to_string(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                if !text.contains(from) {
                    return Err(anyhow!(
                        "{} no longer contains the text this mutation edits: {from:?}; update the mutation",
                        file.display()
                    ));
                }
                std::fs::write(&file, text.replacen(from, to, 1))?;
            }
            Edit::Libs(libs_edit) => edit_libs(prefix, libs_edit)?,
        }
    }
    Ok(())
}

/// Applies a `LibsEdit` to the `Libs:` line of the prefix copy's `.pc` file.
fn edit_libs(prefix: &Path, edit: &LibsEdit) -> Result<()> {
    let pc = prefix
        .join("lib/pkgconfig")
        .join(format!("{}.pc", crate::prefix::PKG_CONFIG_NAME));
    let text =
        std::fs::read_to_string(&pc).with_context(|| format!("cannot read {}", pc.display()))?;
    let mut out = String::new();
    for line in text.lines() {
        if let Some(libs) = line.strip_prefix("Libs:") {
            let mut flags: Vec<&str> = libs.split_whitespace().collect();
            // Positions of the static archives: -lNAME with lib/libNAME.a present.
            let archives: Vec<usize> = flags
                .iter()
                .enumerate()
                .filter(|(_, f)| {
                    f.strip_prefix("-l")
                        .is_some_and(|n| prefix.join("lib").join(format!("lib{n}.a")).is_file())
                })
                .map(|(i, _)| i)
                .collect();
            let at = |n: usize| {
                archives.get(n).copied().ok_or_else(|| {
                    anyhow!(
                        "the link description has {} archives; this mutation needs #{n}",
                        archives.len()
                    )
                })
            };
            match edit {
                LibsEdit::Drop(n) => {
                    flags.remove(at(*n)?);
                }
                LibsEdit::Swap(a, b) => flags.swap(at(*a)?, at(*b)?),
            }
            out.push_str(&format!("Libs: {}\n", flags.join(" ")));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    std::fs::write(&pc, out)?;
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to)?;
    }
    crate::tree::copy_tree(from, to)
}

/// The line that says why: an undefined symbol if there is one, else the
/// first error.
fn first_error_line(output: &str) -> String {
    let undefined = |l: &&str| l.contains("undefined reference") || l.contains("undefined symbol");
    output
        .lines()
        .find(undefined)
        .or_else(|| output.lines().find(|l| l.trim_start().starts_with("error")))
        .unwrap_or("no error line found")
        .trim()
        .to_string()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn print_line(line: &Line) {
    println!(
        "{:<14} {:<36} {:>7.1}s  {}",
        line.verdict, line.name, line.seconds, line.detail
    );
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// Sets every file under `root` to `file` and every folder to `dir`.
    fn set_modes(root: &Path, file: u32, dir: u32) {
        // Folders last, bottom-up, so a read-only folder is not walked after.
        for entry in walkdir::WalkDir::new(root).contents_first(true) {
            let entry = entry.unwrap();
            let mode = if entry.file_type().is_dir() {
                dir
            } else {
                file
            };
            std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        }
    }

    fn write(root: &Path, file: &str, text: &str) {
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// Cargo merges every `.cargo/config.toml` from the working folder up;
    /// the mutant tree must see its own only, or the rustflags double and
    /// every dependency is compiled again.
    #[test]
    fn the_mutant_tree_sees_no_other_cargo_config() {
        let scratch = scratch_folder().unwrap();
        let tree = scratch.path().join("tree");
        assert!(!tree.starts_with(repo_root()));
        let others: Vec<_> = tree
            .ancestors()
            .skip(1)
            .filter(|dir| dir.join(".cargo/config.toml").exists())
            .collect();
        assert!(others.is_empty(), "{others:?} hold a .cargo/config.toml");
    }

    /// The gate mutates copies of a prefix and of a tree that, under Nix,
    /// come from the store: 0444 files in 0555 folders, and the gate runs as
    /// a build user who cannot write through those modes.
    #[test]
    fn mutations_apply_to_copies_of_a_read_only_prefix_and_tree() {
        if crate::unprivileged::rerun_without_dac_override(
            "gate::tests::mutations_apply_to_copies_of_a_read_only_prefix_and_tree",
        ) {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let (prefix, tree) = (store.join("prefix"), store.join("tree"));
        let pc = format!("lib/pkgconfig/{}.pc", crate::prefix::PKG_CONFIG_NAME);
        write(
            &prefix,
            &pc,
            "prefix=/p\nLibs: -L${libdir} -la -lb -lc -lm\n",
        );
        for name in ["a", "b", "c"] {
            write(&prefix, &format!("lib/lib{name}.a"), "!<arch>\n");
        }
        write(&tree, "src/lib.rs", "fn kept() {}\n");
        set_modes(&store, 0o444, 0o555);

        let (prefix_copy, tree_copy) = (dir.path().join("prefix"), dir.path().join("tree"));
        copy_dir(&prefix, &prefix_copy).unwrap();
        crate::tree::copy_checkout(&tree, &tree_copy).unwrap();
        let edits = [
            Edit::Libs(LibsEdit::Drop(1)),
            Edit::Tree {
                file: "src/lib.rs",
                from: "kept",
                to: "mutated",
            },
        ];
        let applied = apply(&edits, &tree_copy, &prefix_copy);
        set_modes(&store, 0o644, 0o755);
        applied.unwrap();
        let libs = std::fs::read_to_string(prefix_copy.join(&pc)).unwrap();
        assert!(libs.contains("Libs: -L${libdir} -la -lc -lm"), "{libs}");
        let source = std::fs::read_to_string(tree_copy.join("src/lib.rs")).unwrap();
        assert_eq!(source, "fn mutated() {}\n");
    }
}
