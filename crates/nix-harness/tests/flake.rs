//! What the flake's derivations assume of the rest of the repository, held
//! to it without building them (with the harness's own scripts, run here
//! without Nix): the evaluated derivations are in
//! `nix/eval/summary.json` (`cargo xtask eval-nix`, kept current by the
//! suite's `eval-nix --check` step), the rest is read from the files the
//! derivations read. Each test here stands for a defect a real Nix build
//! found after evaluation had passed.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The evaluated derivations, or `None` (the test then skips, saying so) in
/// the Nix build's tests' source: the summary records the derivations of the
/// checks that run these tests, so it cannot be part of their source.
fn summary() -> Option<Value> {
    let path = repo_root().join("nix/eval/summary.json");
    if !path.is_file() {
        println!(
            "skipped: nix/eval/summary.json is not in this source tree (the Nix tests' source leaves it out: it records those checks' own derivations)"
        );
        return None;
    }
    let text = std::fs::read_to_string(path).unwrap();
    Some(serde_json::from_str(&text).unwrap())
}

/// The environment of one evaluated output for x86_64-linux.
fn env(summary: &Value, output: &str, name: &str) -> String {
    summary["systems"]["x86_64-linux"][output]["env"][name]
        .as_str()
        .unwrap_or_else(|| panic!("{output} has no {name} in the summary"))
        .to_string()
}

/// The tests' source must hold every repository file the workspace's tests
/// read. nextest ran xtask's tests on the build's source, which has no
/// workflows, CI scripts or IREE patches: 15 failures. `nix/test-data.json`
/// lists what the tests' source adds; these are the paths the tests read
/// that the build's source (`nix/source.nix`) lacks.
#[test]
fn the_nix_test_source_holds_what_the_tests_read() {
    let Some(summary) = summary() else { return };
    const READ_BY_TESTS_ONLY: [&str; 9] = [
        ".github/workflows/ci.yml",
        ".github/workflows/gpu.yml",
        ".github/dependabot.yml",
        ".github/actionlint.yaml",
        ".ci/requirements-lint.txt",
        "nix/iree-patches/cuda-graph-replay.patch",
        // Found by building the tests check: these two were missing.
        "nix/host-cuda-driver.sh",
        "nix/build/setup.sh",
        // The released templates' renderer, once the checks had Jinja2.
        "scripts/chat_template_reference.py",
    ];
    let text = std::fs::read_to_string(repo_root().join("nix/test-data.json")).unwrap();
    let listed: Value = serde_json::from_str(&text).unwrap();
    let listed: Vec<&str> = listed["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    for file in READ_BY_TESTS_ONLY {
        assert!(
            repo_root().join(file).exists(),
            "{file} is gone: update this list"
        );
        assert!(
            listed.iter().any(|p| Path::new(file).starts_with(p)),
            "{file} is read by the tests but not in nix/test-data.json's paths {listed:?}"
        );
    }
    // Every workflow counts, not only those named above.
    for entry in std::fs::read_dir(repo_root().join(".github/workflows")).unwrap() {
        let name = entry.unwrap().file_name();
        let file = Path::new(".github/workflows").join(&name);
        assert!(
            listed.iter().any(|p| file.starts_with(p)),
            "{}",
            file.display()
        );
    }
    // And the checks that run tests use that source: its file is read by
    // the evaluation, so the summary names it.
    assert!(
        summary["read"]["nix/test-data.json"].is_string(),
        "the evaluation never read nix/test-data.json: no check uses the tests' source"
    );
}

/// Outside NixOS, Nix's glibc cannot find the host's `libcuda.so` (it does
/// not read /etc/ld.so.cache), so `nix run .` had no CUDA. The wrappers
/// source nix/host-cuda-driver.sh: given a driver in a folder no loader
/// searches, a program started after it must `dlopen("libcuda.so")`.
#[test]
fn the_wrapper_script_lets_a_program_open_a_driver_the_loader_does_not_know() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host-lib");
    std::fs::create_dir_all(&host).unwrap();
    let compile = |source: &str, args: &[&str], output: &Path| {
        let file = dir.path().join("source.c");
        std::fs::write(&file, source).unwrap();
        let status = Command::new("cc")
            .args(args)
            .arg("-o")
            .arg(output)
            .arg(&file)
            .arg("-ldl")
            .status()
            .unwrap();
        assert!(status.success());
    };
    compile(
        "int cuInit(unsigned flags) { return (int)flags; }\n",
        &["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"],
        &host.join("libcuda.so.1"),
    );
    // What IREE's CUDA driver does: dlopen of that exact name.
    let loader = dir.path().join("loader");
    compile(
        r#"#include <dlfcn.h>
#include <stdio.h>
int main(void) {
  void *driver = dlopen("libcuda.so", RTLD_NOW);
  if (!driver) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(driver, "cuInit");
  printf("%d\n", init(7));
  return 0;
}
"#,
        &[],
        &loader,
    );
    let script = repo_root().join("nix/host-cuda-driver.sh");
    let run = |with_script: bool| {
        let source = if with_script {
            format!(". '{}'; ", script.display())
        } else {
            String::new()
        };
        Command::new("bash")
            .arg("-c")
            .arg(format!("{source}exec '{}'", loader.display()))
            .env(
                "KILN_CUDA_DRIVER_DIRS",
                format!("/nonexistent:{}", host.display()),
            )
            .env("KILN_CACHE_DIR", dir.path().join("cache"))
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap()
    };
    let without = run(false);
    assert!(
        !without.status.success(),
        "libcuda.so loads without the script: the test proves nothing"
    );
    let with = run(true);
    assert!(
        with.status.success() && String::from_utf8_lossy(&with.stdout).trim() == "7",
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    // Only kiln's folder, with the one link, went on the loader's path.
    let folder = dir.path().join("cache/host-cuda-driver");
    let entries: Vec<_> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, ["libcuda.so"]);
    assert_eq!(
        std::fs::read_link(folder.join("libcuda.so")).unwrap(),
        host.join("libcuda.so.1")
    );
}

/// Both wrappers of the flake source that script: `nix run`'s and the dev
/// shell's.
#[test]
fn the_kiln_wrapper_and_the_dev_shell_source_the_driver_script() {
    let Some(summary) = summary() else { return };
    let wrapper = env(&summary, "packages.kiln", "buildCommand");
    assert!(
        wrapper.contains("--run") && wrapper.contains("host-cuda-driver.sh"),
        "{wrapper}"
    );
    let shell = env(&summary, "devShells.default", "shellHook");
    assert!(shell.contains("host-cuda-driver.sh"), "{shell}");
}

/// Every check the flake has for x86_64-linux (as evaluated into the
/// committed summary) and every IREE and kiln package is built.
#[test]
fn every_check_and_package_is_built() {
    let Some(summary) = summary() else {
        return;
    };
    let outputs = summary["systems"]["x86_64-linux"].as_object().unwrap();
    let wanted: Vec<&String> = outputs
        .keys()
        .filter(|k| {
            k.starts_with("checks.")
                || (k.starts_with("packages.")
                    && (k.contains("iree") || k.as_str() == "packages.kiln"))
        })
        .collect();
    assert!(wanted.len() >= 14, "the summary lists {wanted:?}");
    let missing: Vec<&&String> = wanted
        .iter()
        .filter(|k| !nix_harness::build::ALL.contains(&k.as_str()))
        .collect();
    assert!(missing.is_empty(), "nix-build does not build {missing:?}");
}

/// nix/build/setup.sh run as Nix would run it, without Nix: the phases in
/// order, a setup hook's hooks after the phase's own, a replaced phase,
/// a source folder unpacked, patched and installed.
#[test]
fn the_setup_script_runs_phases_and_hooks_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let src = root.join("kiln-src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("greeting"), "hello\n").unwrap();
    std::fs::write(
        root.join("fix.patch"),
        "--- a/greeting\n+++ b/greeting\n@@ -1 +1 @@\n-hello\n+hello, patched\n",
    )
    .unwrap();
    let hook_package = root.join("hook");
    std::fs::create_dir_all(hook_package.join("nix-support")).unwrap();
    std::fs::write(
        hook_package.join("nix-support/setup-hook"),
        "fromHook() { echo hook-postPatch >> \"$TMPDIR/log\"; }\npostPatchHooks+=(fromHook)\n",
    )
    .unwrap();
    let out = root.join("out");
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let status = Command::new("bash")
        .arg("-e")
        .arg(repo_root().join("nix/build/setup.sh"))
        .env_clear()
        // This process's PATH: under Nix, the tests' own tools.
        .env("initialPath", std::env::var_os("PATH").unwrap())
        .env("TMPDIR", &tmp)
        .env("out", &out)
        .env("src", &src)
        .env("patches", root.join("fix.patch"))
        .env("nativeBuildInputs", &hook_package)
        .env("postPatch", "echo own-postPatch >> \"$TMPDIR/log\"")
        .env(
            "buildPhase",
            "runHook preBuild; echo build >> \"$TMPDIR/log\"; runHook postBuild",
        )
        .env("installPhase", "mkdir -p $out; cp greeting $out/")
        .env("doCheck", "")
        .env("checkPhase", "echo check-must-not-run >> \"$TMPDIR/log\"")
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        std::fs::read_to_string(out.join("greeting")).unwrap(),
        "hello, patched\n"
    );
    assert_eq!(
        std::fs::read_to_string(tmp.join("log")).unwrap(),
        "own-postPatch\nhook-postPatch\nbuild\n"
    );
}
