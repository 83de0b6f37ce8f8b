//! The steps of `cargo xtask test` and what became of each: `ran`,
//! `reused` (an earlier green run with the same key) or `deferred` (left out
//! to stay inside the run's time budget). A reused step is never reported as
//! run, a deferred one never as passed.
//!
//! A step's key is a sha256 over what it reads: its name, the content of
//! the files it depends on (a filter over the checkout's source files), the
//! toolchain, the environment that changes its result, and whatever the
//! caller adds (prefix and compiler folders, whose names are their own
//! content keys). A green step leaves a stamp holding its whole key in
//! `$KILN_CACHE_DIR/steps/`; the next run reuses the step only when a stamp
//! of that name holds exactly that key.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow};
use build_support::digest::{Digest, Sha256};

use crate::cache::Cache;
use crate::disk;
use crate::pins::repo_root;

/// What became of a step.
enum Verdict {
    Ran,
    Reused { key: String, when: SystemTime },
    Deferred(String),
}

/// Which source files a step reads.
#[derive(Clone, Copy)]
pub enum Reads {
    /// Every source file of the checkout.
    Everything,
    /// The files whose relative path matches.
    Only(fn(&Path) -> bool),
}

/// A step that can be reused or deferred.
pub struct Keyed<'a> {
    pub name: &'a str,
    pub reads: Reads,
    /// More key material: folders named by their content, flags.
    pub extra: Vec<String>,
    /// What it costs cold, in seconds (measured on 2 cores, docs/ci.md):
    /// with a budget, the step is deferred when it would not fit.
    pub cold_seconds: u64,
    /// May be left out when the budget is short.
    pub deferrable: bool,
    /// May be reused from an earlier green run with the same key.
    pub reusable: bool,
}

pub struct Runner {
    stamps: PathBuf,
    started: Instant,
    budget: Option<Duration>,
    files: Vec<(PathBuf, String)>,
    toolchain: String,
    done: Vec<(String, Verdict)>,
}

impl Runner {
    /// A run whose whole duration should stay within `budget`.
    pub fn new(cache: &Cache, budget: Option<Duration>) -> Result<Runner> {
        let root = repo_root();
        let mut files = Vec::new();
        for file in build_support::tree::source_files(&root)? {
            let hash = build_support::digest::sha256_file(&root.join(&file))?;
            files.push((file, hash));
        }
        files.sort();
        Ok(Runner {
            stamps: cache.path("steps"),
            started: Instant::now(),
            budget,
            files,
            toolchain: toolchain_identity()?,
            done: Vec::new(),
        })
    }

    /// A step that always runs (it is cheap, or its result is a value the
    /// next steps use and that it caches under its own key).
    pub fn run<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.timed(name, Verdict::Ran, f)
    }

    /// A step whose product is a cache folder named by its content key:
    /// reused when that folder is there, intact (its tree matches the digest
    /// recorded when it was made), before the step starts.
    pub fn produce<T>(
        &mut self,
        name: &str,
        folder: &Path,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        // A file here would never be intact, and the step would say `ran`
        // on every run: name the folder, not something in it.
        if folder.exists() && !folder.is_dir() {
            return Err(anyhow!(
                "step {name}: {} is not a cache folder",
                folder.display()
            ));
        }
        let reused = crate::cache::intact(folder)
            .is_ok()
            .then(|| Verdict::Reused {
                key: folder
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                when: modified(folder),
            });
        self.timed(name, reused.unwrap_or(Verdict::Ran), f)
    }

    /// A step with a key: reused on a stamp with the same key, deferred when
    /// the budget has no room for it, else run and stamped when green.
    pub fn keyed(&mut self, step: Keyed, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let key = self.key(&step);
        let stamp = self
            .stamps
            .join(format!("{}-{}", slug(step.name), &key[..16]));
        let verdict = if step.reusable && std::fs::read_to_string(&stamp).is_ok_and(|k| k == key) {
            Some(Verdict::Reused {
                key: key[..16].to_string(),
                when: modified(&stamp),
            })
        } else {
            self.no_room_for(&step).map(Verdict::Deferred)
        };
        // Reused or deferred: nothing runs, and no stamp is written.
        if let Some(verdict) = verdict {
            self.report(step.name, 0.0, &verdict);
            self.done.push((step.name.to_string(), verdict));
            return Ok(());
        }
        self.timed(step.name, Verdict::Ran, f)?;
        if !step.reusable {
            return Ok(());
        }
        crate::cache::write_atomically(&stamp, &key)
    }

    /// The closing lines: how many steps ran and were reused, and every
    /// deferred step by name. Deferred steps are not failures, but they are
    /// not passes either: the last line says so.
    pub fn summary(&self) -> String {
        let count = |f: fn(&Verdict) -> bool| self.done.iter().filter(|(_, v)| f(v)).count();
        let ran = count(|v| matches!(v, Verdict::Ran));
        let reused = count(|v| matches!(v, Verdict::Reused { .. }));
        let deferred: Vec<String> = self
            .done
            .iter()
            .filter_map(|(name, v)| match v {
                Verdict::Deferred(why) => Some(format!("{name} ({why})")),
                _ => None,
            })
            .collect();
        let mut text = format!(
            "xtask test: {ran} steps ran and passed, {reused} reused from earlier green runs, \
             {} deferred, in {:.1} min",
            deferred.len(),
            self.started.elapsed().as_secs_f64() / 60.0
        );
        for line in &deferred {
            text.push_str(&format!("\nxtask test: DEFERRED, NOT RUN: {line}"));
        }
        text
    }

    fn key(&self, step: &Keyed) -> String {
        let mut hash = Sha256::new();
        hash.update(format!("step {}\n", step.name));
        hash.update(&self.toolchain);
        for (file, digest) in &self.files {
            let read = match step.reads {
                Reads::Everything => true,
                Reads::Only(filter) => filter(file),
            };
            if read {
                hash.update(format!("{} {digest}\n", file.display()));
            }
        }
        for extra in &step.extra {
            hash.update(format!("extra {extra}\n"));
        }
        for (name, value) in result_env() {
            hash.update(format!("env {name}={value}\n"));
        }
        build_support::digest::hex(hash)
    }

    fn no_room_for(&self, step: &Keyed) -> Option<String> {
        let budget = self.budget?;
        let elapsed = self.started.elapsed();
        let needed = Duration::from_secs(step.cold_seconds);
        (step.deferrable && elapsed + needed > budget).then(|| {
            format!(
                "{:.1} min elapsed + about {:.1} min cold would pass the {:.0}-minute budget",
                elapsed.as_secs_f64() / 60.0,
                needed.as_secs_f64() / 60.0,
                budget.as_secs_f64() / 60.0
            )
        })
    }

    /// Runs `f` as the step `name`, between its two lines; `verdict` is what
    /// it is recorded as if it succeeds.
    fn timed<T>(
        &mut self,
        name: &str,
        verdict: Verdict,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        eprintln!("==> {name}");
        let started = Instant::now();
        let result = f();
        let seconds = started.elapsed().as_secs_f64();
        if result.is_ok() {
            self.report(name, seconds, &verdict);
            self.done.push((name.to_string(), verdict));
        } else {
            eprintln!(
                "<== {name}: FAILED in {seconds:.1}s (total {:.1} min, {})",
                self.started.elapsed().as_secs_f64() / 60.0,
                disk::free_space_line()
            );
        }
        result.with_context(|| format!("step failed: {name}"))
    }

    fn report(&self, name: &str, seconds: f64, verdict: &Verdict) {
        let what = match verdict {
            Verdict::Ran => format!("ran, ok in {seconds:.1}s"),
            Verdict::Reused { key, when } => {
                format!(
                    "reused (key {key}, stamped {}) in {seconds:.1}s",
                    age(*when)
                )
            }
            Verdict::Deferred(why) => format!("DEFERRED, not run: {why}"),
        };
        eprintln!(
            "<== {name}: {what} (total {:.1} min, {})",
            self.started.elapsed().as_secs_f64() / 60.0,
            disk::free_space_line()
        );
    }
}

/// The environment that changes what a step finds: Rust flags and
/// profiles, and kiln's own switches (`KILN_REQUIRE_MODELS` makes tests
/// that would skip fail instead). Not where things are kept.
fn result_env() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(name, _)| {
            (name.starts_with("KILN_") && name != "KILN_CACHE_DIR")
                || name.starts_with("RUSTFLAGS")
                || name.starts_with("CARGO_PROFILE_")
                || name.starts_with("CARGO_BUILD_")
                || name == "RUSTDOCFLAGS"
        })
        .collect();
    vars.sort();
    vars
}

/// rustc's and cargo's versions: a new toolchain reruns everything.
fn toolchain_identity() -> Result<String> {
    let mut identity = String::new();
    for (program, arg) in [("rustc", "-vV"), ("cargo", "-V")] {
        let version =
            crate::process::read(Command::new(program).arg(arg).current_dir(repo_root()))?;
        identity.push_str(&version);
        identity.push('\n');
    }
    Ok(identity)
}

fn slug(name: &str) -> String {
    let slug: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    slug.split('-')
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("-")
        .chars()
        .take(60)
        .collect()
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// How long ago `when` was, in words a log reader can compare.
fn age(when: SystemTime) -> String {
    let seconds = SystemTime::now()
        .duration_since(when)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    if seconds < 3_600.0 {
        format!("{:.0} min ago", seconds / 60.0)
    } else {
        format!("{:.1} h ago", seconds / 3_600.0)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    fn runner(dir: &Path, budget: Option<Duration>) -> Runner {
        Runner {
            stamps: dir.join("steps"),
            started: Instant::now(),
            budget,
            files: vec![
                (PathBuf::from("a.rs"), "1".into()),
                (PathBuf::from("flake.nix"), "2".into()),
            ],
            toolchain: "rustc 1.95.0".into(),
            done: Vec::new(),
        }
    }

    /// A reusable step of a second, never deferred.
    fn step(name: &str) -> Keyed<'_> {
        Keyed {
            name,
            reads: Reads::Everything,
            extra: vec!["prefix-abc".into()],
            cold_seconds: 1,
            deferrable: false,
            reusable: true,
        }
    }

    #[test]
    fn a_product_is_reused_only_when_its_folder_is_intact() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path());
        let mut steps = runner(dir.path(), None);
        let folder = cache.path("iree-runtime/cpu-0123");
        let fill = |staging: &Path| std::fs::write(staging.join("lib.a"), b"a").map_err(Into::into);
        // Made, reused, then made again after an edit.
        for edit in [false, false, true] {
            if edit {
                std::fs::write(folder.join("lib.a"), b"edited").unwrap();
            }
            let publish = || cache.publish(&folder, fill);
            steps.produce("prefix", &folder, publish).unwrap();
        }
        let verdicts: Vec<bool> = steps
            .done
            .iter()
            .map(|(_, v)| matches!(v, Verdict::Reused { .. }))
            .collect();
        assert_eq!(verdicts, [false, true, false]);
        // A file is refused: the compiler's binary, passed where its folder
        // belongs, made the step say `ran` on every warm run.
        let binary = dir.path().join("iree-compile");
        std::fs::write(&binary, b"").unwrap();
        let error = steps
            .produce("iree-compile", &binary, || Ok(()))
            .unwrap_err();
        assert!(
            format!("{error:#}").contains("is not a cache folder"),
            "{error:#}"
        );
    }

    /// A step's work: counts its runs under `name`.
    fn work<'a>(
        runs: &'a RefCell<Vec<&'static str>>,
        name: &'static str,
    ) -> impl FnOnce() -> Result<()> + 'a {
        move || {
            runs.borrow_mut().push(name);
            Ok(())
        }
    }

    #[test]
    fn a_green_step_is_reused_only_with_the_same_key() {
        let dir = tempfile::tempdir().unwrap();
        let runs = RefCell::new(Vec::new());
        let mut first = runner(dir.path(), None);
        first.keyed(step("tests"), work(&runs, "1")).unwrap();
        first.keyed(step("tests"), work(&runs, "2")).unwrap();
        assert_eq!(*runs.borrow(), ["1"], "the second run had the first's key");
        assert!(matches!(first.done[1].1, Verdict::Reused { .. }));
        // Another file content, another key: it runs.
        let mut edited = runner(dir.path(), None);
        edited.files[0].1 = "changed".into();
        edited.keyed(step("tests"), work(&runs, "3")).unwrap();
        // A step reading only the Nix files is not rerun by the Rust edit.
        let nix = |name| Keyed {
            reads: Reads::Only(|p| p.extension().is_some_and(|e| e == "nix")),
            ..step(name)
        };
        runner(dir.path(), None)
            .keyed(nix("lint"), work(&runs, "4"))
            .unwrap();
        edited.keyed(nix("lint"), work(&runs, "5")).unwrap();
        // A step that is never reused runs every time.
        let repro = || Keyed {
            reusable: false,
            ..step("repro")
        };
        edited.keyed(repro(), work(&runs, "6")).unwrap();
        edited.keyed(repro(), work(&runs, "7")).unwrap();
        assert_eq!(*runs.borrow(), ["1", "3", "4", "6", "7"]);
    }

    #[test]
    fn a_failed_step_leaves_no_stamp_and_a_forged_stamp_is_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let mut runner = runner(dir.path(), None);
        let failed = runner.keyed(step("gate"), || Err(anyhow!("red")));
        assert!(failed.is_err());
        let key = runner.key(&step("gate"));
        let stamp = dir
            .path()
            .join("steps")
            .join(format!("gate-{}", &key[..16]));
        assert!(!stamp.exists());
        // A stamp whose name matches but whose content is not the whole key.
        std::fs::create_dir_all(stamp.parent().unwrap()).unwrap();
        std::fs::write(&stamp, &key[..16]).unwrap();
        let runs = RefCell::new(Vec::new());
        runner.keyed(step("gate"), work(&runs, "gate")).unwrap();
        assert_eq!(*runs.borrow(), ["gate"]);
        assert_eq!(std::fs::read_to_string(&stamp).unwrap(), key);
    }

    #[test]
    fn only_deferrable_steps_are_deferred_and_the_summary_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut runner = runner(dir.path(), Some(Duration::from_secs(60)));
        let runs = RefCell::new(Vec::new());
        let cold = |name, deferrable, cold_seconds| Keyed {
            deferrable,
            cold_seconds,
            ..step(name)
        };
        for (name, deferrable, cold_seconds) in [
            ("repro", true, 3_600),
            ("gate", false, 3_600),
            ("ptxas", true, 1),
        ] {
            let step = cold(name, deferrable, cold_seconds);
            runner.keyed(step, work(&runs, name)).unwrap();
        }
        assert_eq!(*runs.borrow(), ["gate", "ptxas"]);
        let summary = runner.summary();
        assert!(summary.contains("2 steps ran and passed"), "{summary}");
        assert!(summary.contains("1 deferred"), "{summary}");
        assert!(summary.contains("DEFERRED, NOT RUN: repro ("), "{summary}");
        // A deferred step leaves no stamp: the next run does not reuse it.
        let stamps: Vec<String> = std::fs::read_dir(dir.path().join("steps"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!stamps.iter().any(|s| s.starts_with("repro")), "{stamps:?}");
    }
}
