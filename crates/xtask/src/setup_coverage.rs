//! Tests over the whole of xtask and the pages: every program a step
//! checks for, and every package a message or page tells the reader to
//! install, is one `cargo xtask setup` installs ([`SYSTEM_PACKAGES`]). They
//! read every module, so they live in none of them.

use crate::pins::repo_root;
use crate::target::{AARCH64, Target};
use crate::tools::{SYSTEM_PACKAGES, package_of};

/// The string literals passed as first argument to `function(` in `text`.
fn literal_arguments<'a>(text: &'a str, function: &str) -> Vec<&'a str> {
    text.match_indices(&format!("{function}("))
        .filter_map(|(at, call)| {
            let rest = text[at + call.len()..].trim_start().strip_prefix('"')?;
            rest.split_once('"').map(|(literal, _)| literal)
        })
        .collect()
}

/// The source files of xtask and of the plumbing it runs programs with
/// (crates/build-support), each without its tests (which call the checks
/// with programs that are not meant to exist).
fn xtask_sources() -> Vec<(String, String)> {
    ["crates/xtask/src", "crates/build-support/src"]
        .iter()
        .flat_map(|dir| walkdir::WalkDir::new(repo_root().join(dir)))
        .map(|entry| entry.unwrap().into_path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            (path.display().to_string(), code.to_string())
        })
        .collect()
}

/// Every program a step checks for (or names in a hint) is in a package
/// of setup's table, and so is every package a hint names: a check
/// added without its package fails here, not on a fresh machine.
#[test]
fn every_program_the_steps_check_for_is_in_a_package_setup_installs() {
    let aarch64 = Target::parse(Some(AARCH64)).unwrap();
    let mut programs: Vec<String> = [
        crate::kernels::CLANG,
        "cc",
        "c++",
        &aarch64.cc(),
        &aarch64.cxx(),
        &format!("qemu-{}", aarch64.arch()),
    ]
    .iter()
    .chain(&nix_harness::build::HOST_PROGRAMS)
    .chain(&nix_harness::eval::PROGRAMS)
    .map(|p| p.to_string())
    .collect();
    let mut packages: Vec<String> = Vec::new();
    for (file, text) in xtask_sources() {
        for function in ["require_host_program", "install_hint"] {
            for program in literal_arguments(&text, function) {
                assert!(!program.is_empty(), "an empty program name in {file}");
                programs.push(program.to_string());
            }
        }
        packages.extend(
            literal_arguments(&text, "package_hint")
                .into_iter()
                .map(String::from),
        );
    }
    // The scan found the literal calls (pkg-config's, nix's, ...).
    assert!(programs.iter().any(|p| p == "pkg-config"), "{programs:?}");
    assert!(packages.iter().any(|p| p == "libclang-dev"), "{packages:?}");
    let unknown: Vec<&String> = programs
        .iter()
        .filter(|p| package_of(p).is_none())
        .collect();
    assert!(
        unknown.is_empty(),
        "checked for, but in no package of tools::SYSTEM_PACKAGES: {unknown:?}"
    );
    let names: Vec<&str> = SYSTEM_PACKAGES.iter().map(|p| p.name).collect();
    let not_installed: Vec<&String> = packages
        .iter()
        .filter(|p| !names.contains(&p.as_str()))
        .collect();
    assert!(
        not_installed.is_empty(),
        "named in a hint, but not installed by setup: {not_installed:?}"
    );
}

/// The packages after each `apt-get install` in `text` (options skipped;
/// a placeholder such as `{package}` or `$program` ends the list).
fn apt_packages(text: &str) -> Vec<String> {
    let mut packages = Vec::new();
    for (at, needle) in text.match_indices("apt-get install") {
        let line = text[at + needle.len()..].lines().next().unwrap_or_default();
        for word in line.split_whitespace() {
            if word.starts_with('-') {
                continue;
            }
            let name = word.trim_end_matches([')', ',', '`', '"', ';', '.', '\'', '\\']);
            let valid = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c));
            if !valid {
                break;
            }
            packages.push(name.to_string());
            if name.len() != word.len() {
                break;
            }
        }
    }
    packages
}

#[test]
fn apt_packages_are_read_from_hints() {
    assert_eq!(
        apt_packages("(Debian/Ubuntu: apt-get install -y nix-bin jq), or else"),
        ["nix-bin", "jq"]
    );
    assert_eq!(
        apt_packages("`apt-get install -y libclang-dev`, or set"),
        ["libclang-dev"]
    );
    assert!(apt_packages("apt-get install -y {package}").is_empty());
    assert!(apt_packages("apt-get install $program").is_empty());
}

/// Every package that a message, build script, CI script or page tells
/// the reader to install with apt is one `cargo xtask setup` installs.
#[test]
fn every_package_a_message_or_page_names_is_one_setup_installs() {
    let root = repo_root();
    let mut files: Vec<(String, String)> = xtask_sources();
    let mut others: Vec<std::path::PathBuf> = [
        "crates/kiln-iree/build.rs",
        "build.rs",
        ".ci/run",
        ".ci/hardening",
        "README.md",
    ]
    .iter()
    .map(|f| root.join(f))
    .collect();
    // The Nix build's test source has no docs or CI scripts.
    if let Ok(docs) = std::fs::read_dir(root.join("docs")) {
        others.extend(docs.map(|e| e.unwrap().path()));
    }
    for path in others.iter().filter(|p| p.is_file()) {
        files.push((
            path.display().to_string(),
            std::fs::read_to_string(path).unwrap(),
        ));
    }
    // kiln-iree's build script cannot call xtask: it names its packages,
    // and the scan must see them.
    let build_script = std::fs::read_to_string(root.join("crates/kiln-iree/build.rs")).unwrap();
    let named = apt_packages(&build_script);
    for package in ["libclang-dev", "pkg-config", "build-essential"] {
        assert!(named.iter().any(|p| p == package), "{named:?}");
    }
    let names: Vec<&str> = SYSTEM_PACKAGES.iter().map(|p| p.name).collect();
    let mut problems = Vec::new();
    for (file, text) in &files {
        for package in apt_packages(text) {
            if !names.contains(&package.as_str()) {
                problems.push(format!("{file}: {package}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "apt packages named but not installed by `cargo xtask setup`: {problems:?}"
    );
}
