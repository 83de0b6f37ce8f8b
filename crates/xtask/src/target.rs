//! The machine a build is for: this host, or another architecture built here
//! with Debian's cross toolchain (`aarch64-linux-gnu-gcc`, GNU ld) and run
//! under user-mode emulation (`qemu-aarch64`). The GB10 is aarch64.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::tools::require_host_program;

/// The Rust target triples kiln builds for, with the Nix system that names
/// their pins and the GNU triple of their C toolchain.
const KNOWN: [(&str, &str, &str); 2] = [
    (
        "x86_64-unknown-linux-gnu",
        "x86_64-linux",
        "x86_64-linux-gnu",
    ),
    (
        "aarch64-unknown-linux-gnu",
        "aarch64-linux",
        "aarch64-linux-gnu",
    ),
];

/// The GB10's target.
pub const AARCH64: &str = "aarch64-unknown-linux-gnu";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The Rust triple (`aarch64-unknown-linux-gnu`).
    pub triple: &'static str,
    /// The Nix system that names this target's pins (`aarch64-linux`).
    pub system: &'static str,
    /// The GNU triple: the cross tools' prefix and the sysroot's name.
    gnu: &'static str,
    /// Built on another architecture than this one.
    pub cross: bool,
}

impl Target {
    /// This machine's own target.
    pub fn host() -> Result<Target> {
        if std::env::consts::OS != "linux" {
            return Err(anyhow!(
                "kiln builds IREE on Linux only; this is {}",
                std::env::consts::OS
            ));
        }
        let arch = std::env::consts::ARCH;
        Self::find(|triple| triple.starts_with(&format!("{arch}-")), false).ok_or_else(|| {
            anyhow!("kiln knows no Linux target for this machine's architecture, {arch}")
        })
    }

    /// `--target TRIPLE`, or the host without one.
    pub fn parse(triple: Option<&str>) -> Result<Target> {
        let host = Self::host()?;
        let Some(triple) = triple else {
            return Ok(host);
        };
        Self::find(|t| t == triple, triple != host.triple).ok_or_else(|| {
            let known: Vec<&str> = KNOWN.iter().map(|k| k.0).collect();
            anyhow!(
                "kiln does not build for the target {triple}; it builds for: {}",
                known.join(", ")
            )
        })
    }

    fn find(matches: impl Fn(&str) -> bool, cross: bool) -> Option<Target> {
        KNOWN
            .iter()
            .find(|(triple, _, _)| matches(triple))
            .map(|&(triple, system, gnu)| Target {
                triple,
                system,
                gnu,
                cross,
            })
    }

    /// `aarch64` from `aarch64-unknown-linux-gnu`.
    pub fn arch(&self) -> &'static str {
        self.triple.split('-').next().expect("a triple has parts")
    }

    /// The prefix folders' and logs' name for this target: empty for the host.
    pub fn cache_tag(&self) -> String {
        if self.cross {
            format!("{}-", self.system)
        } else {
            String::new()
        }
    }

    /// The C and C++ compilers that build IREE for this target, with their
    /// identities (part of a prefix's cache key: another compiler makes
    /// another prefix).
    pub fn c_toolchain(&self) -> Result<Vec<String>> {
        let (cc, cxx) = match self.cross {
            true => (self.cc(), self.cxx()),
            false => ("cc".into(), "c++".into()),
        };
        Ok(vec![
            require_host_program(&cc, "the C compiler that builds IREE's runtime")?,
            require_host_program(&cxx, "the C++ compiler CMake requires for IREE")?,
        ])
    }

    /// The GNU triple (`aarch64-linux-gnu`).
    pub fn gnu(&self) -> &'static str {
        self.gnu
    }

    pub fn cc(&self) -> String {
        format!("{}-gcc", self.gnu)
    }

    pub fn cxx(&self) -> String {
        format!("{}-g++", self.gnu)
    }

    /// Debian's sysroot of the cross libc (`libc6-dev-arm64-cross`).
    pub fn sysroot(&self) -> PathBuf {
        PathBuf::from("/usr").join(self.gnu)
    }

    /// The environment of a cargo build for this target: for a cross target,
    /// its linker (the cross gcc, GNU ld, as on the machine itself) and its
    /// runner (user-mode emulation with the cross sysroot); nothing for the
    /// host. They live here, not in `.cargo/config.toml`, because that file
    /// is read by native builds of the target too, which have no cross gcc.
    pub fn cargo_env(&self) -> Vec<(String, String)> {
        if !self.cross {
            return Vec::new();
        }
        let var = self.triple.to_uppercase().replace('-', "_");
        vec![
            (format!("CARGO_TARGET_{var}_LINKER"), self.cc()),
            (
                format!("CARGO_TARGET_{var}_RUNNER"),
                format!("qemu-{} -L {}", self.arch(), self.sysroot().display()),
            ),
        ]
    }

    /// A command that runs a program built for this target: the program
    /// itself on the host, under `qemu-ARCH` with the cross sysroot otherwise.
    pub fn runner(&self, program: impl Into<PathBuf>) -> Result<Command> {
        if !self.cross {
            return Ok(Command::new(program.into()));
        }
        let qemu = format!("qemu-{}", self.arch());
        require_host_program(&qemu, "user-mode emulation of the target")?;
        let mut command = Command::new(qemu);
        command.arg("-L").arg(self.sysroot()).arg(program.into());
        Ok(command)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No triple is the host, and so is the host's own triple (never
    /// cross); aarch64 is known with its system and tools; an unknown triple
    /// is named with the known ones.
    #[test]
    fn triples_are_parsed_into_targets() {
        let host = Target::parse(None).unwrap();
        assert!(!host.cross);
        assert!(host.triple.starts_with(std::env::consts::ARCH));
        assert_eq!(host.cache_tag(), "");
        assert_eq!(Target::parse(Some(host.triple)).unwrap(), host);
        let target = Target::parse(Some("aarch64-unknown-linux-gnu")).unwrap();
        assert_eq!(target.system, "aarch64-linux");
        assert_eq!(target.arch(), "aarch64");
        assert_eq!(target.cc(), "aarch64-linux-gnu-gcc");
        assert_eq!(target.sysroot(), PathBuf::from("/usr/aarch64-linux-gnu"));
        assert_eq!(target.cross, std::env::consts::ARCH != "aarch64");
        let error = Target::parse(Some("riscv64gc-unknown-linux-gnu"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("riscv64gc-unknown-linux-gnu"), "{error}");
        assert!(error.contains("aarch64-unknown-linux-gnu"), "{error}");
    }

    #[test]
    fn only_a_cross_build_gets_a_linker_and_runner() {
        assert!(Target::host().unwrap().cargo_env().is_empty());
        let mut aarch64 = Target::parse(Some(AARCH64)).unwrap();
        aarch64.cross = true;
        assert_eq!(
            aarch64.cargo_env(),
            [
                (
                    "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER".to_string(),
                    "aarch64-linux-gnu-gcc".to_string()
                ),
                (
                    "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER".to_string(),
                    "qemu-aarch64 -L /usr/aarch64-linux-gnu".to_string()
                ),
            ]
        );
    }

    /// `.cargo/config.toml` is read by every build of this source: crane's
    /// native build on an aarch64 machine (the GB10) too, where a
    /// `linker = "aarch64-linux-gnu-gcc"` names a program its toolchain does
    /// not have. No target of it may set a linker or a runner.
    #[test]
    fn the_cargo_config_sets_no_target_linker_or_runner() {
        let config =
            std::fs::read_to_string(crate::pins::repo_root().join(".cargo/config.toml")).unwrap();
        let mut section = String::new();
        let mut found = Vec::new();
        for line in config.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
            } else if section.starts_with("[target.")
                && ["linker", "runner"]
                    .iter()
                    .any(|key| line.split('=').next().map(str::trim) == Some(key))
            {
                found.push(format!("{section} {line}"));
            }
        }
        assert!(found.is_empty(), "{found:?}");
    }
}
