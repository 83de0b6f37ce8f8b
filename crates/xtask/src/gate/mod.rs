//! `cargo xtask gate`: the link check and its self-test, the mutation suite.
//!
//! The link check links every target of the workspace (binaries, tests,
//! benches, examples) in the release profile with `cuda,xla-iree`, running
//! none. The mutation suite proves the check would catch link-only
//! regressions: for each mutation, on a copy of the tree (and of the prefix),
//! `cargo check` must still pass and the link must fail with the expected
//! text. A mutant is checked and linked for the smallest set of the link
//! check's targets that links and reaches the mutated code (kiln-iree's
//! tests, or kiln-xla's `iree_runtime` test): its failure is the link check's,
//! at a fraction of the cost of relinking every target. Every run shares the checkout's own target folder (under
//! Nix, the one crane filled with the dependency artifacts), so neither the
//! link check nor the mutants compile a dependency again; the mutated tree
//! lives outside the checkout, where cargo reads no second
//! `.cargo/config.toml` (two would repeat the rustflags, and new rustflags
//! mean every dependency recompiled).

mod mutations;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use serde::Serialize;
use serde_json::Value;

use crate::pins::repo_root;
use crate::target::Target;
use mutations::{Edit, LibsEdit, MUTANT_BUILT_PACKAGES, MUTATIONS, Mutation, Targets};

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
    /// Every target shares the one target folder: cargo keeps each target's
    /// artifacts apart inside it (`target/TRIPLE/`), and the build scripts
    /// and proc macros, built for the host, are shared.
    target_dir: PathBuf,
}

impl<'a> Build<'a> {
    fn new(prefix: &'a Path, target: &'a Target) -> Self {
        let target_dir = crate::process::target_dir();
        Build {
            prefix,
            target,
            target_dir,
        }
    }
}

/// What one gate run does beyond the link check.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Only the link check, no mutation suite.
    #[arg(long)]
    pub link_only: bool,
    /// Run only the named mutation.
    #[arg(long)]
    pub mutation: Option<String>,
    /// Also write the report (report-TRIPLE.json) into this folder, made if
    /// absent: the Nix check's `$out` (no caller need know the report's name).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl Options {
    /// The link check alone.
    pub fn link_only() -> Self {
        Options {
            link_only: true,
            ..Default::default()
        }
    }
}

/// The report's file name for `target`.
pub fn report_name(target: &Target) -> String {
    format!("report-{}.json", target.triple)
}

/// Runs the link check and, unless `options.link_only`, the mutation suite;
/// prints the report and writes it as JSON. Fails if any line failed.
pub fn run(prefix: &Path, target: &Target, options: &Options) -> Result<()> {
    let (only, out) = (options.mutation.as_deref(), options.out.as_deref());
    let root = repo_root();
    let build = Build::new(prefix, target);
    let work = build.target_dir.join("gate");
    std::fs::create_dir_all(&work)?;
    let scratch = scratch_folder()?;
    let mut report: Vec<Line> = Vec::new();

    let started = Instant::now();
    let link = cargo(&root, &build, prefix, &Scope::Workspace.args(LINK, target))?;
    let ok = link.success;
    let (verdict, detail) = match ok {
        true => ("PASS", "every target linked".into()),
        false => ("FAIL", first_error_line(&link.output)),
    };
    let models = format!(
        "every release {FEATURES} target links for {}",
        target.triple
    );
    report.push(Line {
        name: "link-check".into(),
        models,
        verdict,
        seconds: started.elapsed().as_secs_f64(),
        detail,
    });
    print_line(report.last().expect("just pushed"));
    if !ok {
        eprintln!("{}", tail(&link.output, 40));
    }

    if ok && !options.link_only {
        let suite = (|| -> Result<()> {
            for mutation in MUTATIONS
                .iter()
                .filter(|m| only.is_none_or(|o| o == m.name))
            {
                let line = run_mutation(mutation, &root, &build, scratch.path(), &work)?;
                print_line(&line);
                report.push(line);
            }
            Ok(())
        })();
        let forgotten = forget_mutant_artifacts(&root, &build);
        suite?;
        forgotten?;
    }

    let failed = report
        .iter()
        .filter(|l| !matches!(l.verdict, "PASS" | "CAUGHT" | "SKIPPED"))
        .count();
    let passed = report.iter().filter(|l| l.verdict != "SKIPPED").count() - failed;
    let json = work.join(report_name(target));
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(&json, &text)?;
    if let Some(out) = out {
        std::fs::create_dir_all(out)
            .and_then(|()| std::fs::write(out.join(report_name(target)), &text))
            .with_context(|| format!("cannot write the report into {}", out.display()))?;
    }
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

/// Mutants share the checkout's target folder, and cargo names a workspace
/// crate's artifacts after its path relative to the workspace root, which is
/// the same in a mutant's copy: a mutant's kiln-iree replaces the checkout's,
/// and cargo, finding the checkout's sources older than it, would take it as
/// current — the next link check would link the last mutant. So the release
/// artifacts of the packages mutants build are removed once the suite ends,
/// and the checkout's next build makes its own.
fn forget_mutant_artifacts(root: &Path, build: &Build) -> Result<()> {
    let mut args = vec!["clean", "--release"];
    for package in MUTANT_BUILT_PACKAGES {
        args.extend(["--package", package]);
    }
    let outcome = cargo(root, build, build.prefix, &args)?;
    if !outcome.success {
        return Err(anyhow!(
            "cannot remove the mutants' artifacts from {} (remove them with `cargo clean`): {}",
            build.target_dir.display(),
            tail(&outcome.output, 10)
        ));
    }
    Ok(())
}

/// A test executable the link check builds.
pub struct TestExecutable {
    /// The cargo target's kind (`lib`, `test`, …) and name (`kiln_core`).
    pub kind: String,
    pub name: String,
    pub path: PathBuf,
    /// The folder of its package's Cargo.toml (cargo runs tests there).
    pub package_dir: PathBuf,
}

/// The test executables of the link check for `target`, against `prefix`:
/// the link check's own command (so nothing is built that it did not build),
/// asked to list what it made.
pub fn test_executables(prefix: &Path, target: &Target) -> Result<Vec<TestExecutable>> {
    let build = Build::new(prefix, target);
    let mut args = Scope::Workspace.args(LINK, target);
    args.push("--message-format=json-render-diagnostics");
    let outcome = cargo(&repo_root(), &build, prefix, &args)?;
    if !outcome.success {
        return Err(anyhow!(
            "the link check for {} failed:\n{}",
            target.triple,
            tail(&outcome.output, 40)
        ));
    }
    parse_test_executables(&outcome.output)
}

/// The test executables among cargo's JSON messages (one object a line).
fn parse_test_executables(messages: &str) -> Result<Vec<TestExecutable>> {
    let mut found = Vec::new();
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let message: Value = serde_json::from_str(line)
            .with_context(|| format!("cargo printed a message xtask cannot read: {line}"))?;
        let text = |pointer| message.pointer(pointer).and_then(Value::as_str);
        let (Some(kind), Some(name), Some(path), Some(manifest)) = (
            text("/target/kind/0"),
            text("/target/name"),
            text("/executable"),
            text("/manifest_path"),
        ) else {
            continue;
        };
        // An executable of the test profile (a binary's is not a test).
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        found.push(TestExecutable {
            kind: kind.into(),
            name: name.into(),
            path: path.into(),
            package_dir: Path::new(manifest).parent().unwrap_or(Path::new("")).into(),
        });
    }
    Ok(found)
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

/// The targets a cargo command builds: every target of the workspace with the
/// gate's features (the link check), or a mutant's (see [`Targets`]).
#[derive(Clone, Copy)]
enum Scope {
    Workspace,
    Mutant(&'static Targets),
}

/// The link check: `cargo test --release --no-run --locked [--target T]`
/// over a scope, RUSTFLAGS untouched (over the workspace: `cargo test
/// --release --features cuda,xla-iree --workspace --all-targets --no-run
/// --locked`).
const LINK: &[&str] = &["test", "--release", "--no-run", "--locked"];
/// What a mutant must still pass: its regression is link-only.
const CHECK: &[&str] = &["check", "--locked"];

impl Scope {
    /// `command` ([`LINK`] or [`CHECK`]) over this scope.
    fn args(self, command: &[&'static str], target: &Target) -> Vec<&'static str> {
        let mut args = command.to_vec();
        match self {
            Scope::Workspace => {
                args.extend(["--features", FEATURES, "--workspace", "--all-targets"]);
                // xtask is the build host's tool and is never built for
                // another target: a cross link check leaves it (and its own
                // dependencies) out.
                if target.cross {
                    args.extend(["--exclude", "xtask"]);
                }
            }
            Scope::Mutant(targets) => args.extend(targets.select),
        }
        args
    }
}

/// Runs cargo with `args` in `tree`, for the build's target, against
/// `prefix` (the build's prefix or a mutant's copy).
fn cargo(tree: &Path, build: &Build, prefix: &Path, args: &[&str]) -> Result<Outcome> {
    let mut command = crate::process::cargo();
    command.args(args);
    if build.target.cross {
        command.args(["--target", build.target.triple]);
    }
    command.envs(build.target.cargo_env());
    let (status, output) = crate::process::output_text(
        command
            .current_dir(tree)
            .env("KILN_IREE_PREFIX", prefix)
            .env("CARGO_TARGET_DIR", &build.target_dir)
            .env("CARGO_TERM_COLOR", "never"),
    )?;
    Ok(Outcome {
        success: status.success(),
        output,
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
    build_support::tree::copy_checkout(root, &tree)?;
    copy_dir(build.prefix, &mutant_prefix)?;
    if let Err(error) = apply(mutation.edits, &tree, &mutant_prefix) {
        return Ok(line(
            "BROKEN",
            started.elapsed().as_secs_f64(),
            format!("{error:#}"),
        ));
    }
    let scope = Scope::Mutant(mutation.targets);
    let checked = cargo(
        &tree,
        build,
        &mutant_prefix,
        &scope.args(CHECK, build.target),
    )?;
    let verdict = if !checked.success {
        line("NOT LINK-ONLY", 0.0, first_error_line(&checked.output))
    } else {
        let link = scope.args(LINK, build.target);
        let linked = cargo(&tree, build, &mutant_prefix, &link)?;
        let logs = work.join("logs");
        std::fs::create_dir_all(&logs)?;
        std::fs::write(
            logs.join(format!("{}-{}.log", build.target.triple, mutation.name)),
            format!(
                "{}'s targets: cargo {}\n{}",
                mutation.targets.package,
                link.join(" "),
                linked.output
            ),
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
    build_support::tree::copy_tree(from, to)
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

    #[test]
    fn test_executables_are_read_from_cargos_messages() {
        let messages = [
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/kiln-core/Cargo.toml","target":{"kind":["lib"],"name":"kiln_core"},"profile":{"test":true},"executable":"/t/kiln_core-1"}"#,
            // The library itself, not its tests: no executable.
            r#"{"reason":"compiler-artifact","manifest_path":"/w/crates/kiln-core/Cargo.toml","target":{"kind":["lib"],"name":"kiln_core"},"profile":{"test":false},"executable":null}"#,
            // A binary: an executable, but not a test.
            r#"{"reason":"compiler-artifact","manifest_path":"/w/Cargo.toml","target":{"kind":["bin"],"name":"kiln"},"profile":{"test":false},"executable":"/t/kiln"}"#,
            r#"{"reason":"compiler-artifact","manifest_path":"/w/Cargo.toml","target":{"kind":["test"],"name":"xla_prepared_prefill"},"profile":{"test":true},"executable":"/t/xla_prepared_prefill-2"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "   Finished `release` profile",
        ]
        .join("\n");
        let found = parse_test_executables(&messages).unwrap();
        let seen: Vec<_> = found
            .iter()
            .map(|t| (t.kind.as_str(), t.name.as_str(), t.path.to_str().unwrap()))
            .collect();
        assert_eq!(
            seen,
            [
                ("lib", "kiln_core", "/t/kiln_core-1"),
                ("test", "xla_prepared_prefill", "/t/xla_prepared_prefill-2")
            ]
        );
        assert_eq!(found[0].package_dir, Path::new("/w/crates/kiln-core"));
        assert!(parse_test_executables("{not json").is_err());
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
        if crate::rerun::rerun_without_dac_override(
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
        build_support::tree::copy_checkout(&tree, &tree_copy).unwrap();
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
