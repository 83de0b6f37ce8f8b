//! The pin file, `nix/pins.json`: every pinned input of the build, read the
//! same way by Nix (`builtins.fromJSON`) and by xtask (this module).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

/// A file fetched by URL and checked by sha256 before use.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Download {
    pub name: String,
    pub url: String,
    pub sha256: String,
}

#[derive(Debug, Deserialize)]
pub struct Pins {
    pub iree: Iree,
    pub cuda: Cuda,
    pub tools: Tools,
    /// Files others released that the tests hold kiln to, by archive
    /// (`_`-prefixed keys are comments).
    pub reference_files: BTreeMap<String, serde_json::Value>,
}

/// An archive of [`Pins::reference_files`].
#[derive(Debug, Deserialize)]
pub struct ReferenceArchive {
    #[serde(flatten)]
    pub download: Download,
    pub description: String,
    /// Each member's path inside the archive, and the sha256 it must have.
    pub members: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
pub struct Iree {
    pub version: String,
    pub revision: String,
    pub source: Source,
    pub compiler: Compiler,
    pub cmake_options: CmakeOptions,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct Source {
    #[serde(flatten)]
    pub download: Download,
    /// The folder inside the tarball that holds the IREE tree.
    pub subdir: String,
}

#[derive(Debug, Deserialize)]
pub struct Compiler {
    /// Path of the native `iree-compile` inside the wheel.
    pub binary: String,
    /// The wheel members an installation consists of (the binary among them,
    /// all in its folder): what Nix installs and what xtask unpacks.
    pub files: Vec<String>,
    /// What `iree-compile --version` prints for the pinned build.
    pub version_line: String,
    /// One wheel per Nix system name (`x86_64-linux`, …).
    pub wheels: BTreeMap<String, Download>,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct CmakeOptions {
    pub common: BTreeMap<String, String>,
    pub cuda: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
pub struct Cuda {
    /// The GPU capabilities kiln targets (`12.1` is sm_121).
    pub capabilities: Vec<String>,
    pub wheels: BTreeMap<String, CudaWheel>,
}

#[derive(Debug, Deserialize, Serialize)]
pub struct CudaWheel {
    pub version: String,
    /// The nixpkgs package (of `cudaPackages`) this wheel stands for.
    pub nixpkgs: String,
    /// Where the wheel holds ptxas (the nvcc wheel only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ptxas: Option<String>,
    /// `[from, to]` pairs: a folder of the unpacked wheel and where it goes in
    /// `IREE_CUDA_DEPS_DIR`.
    pub layout: Vec<(String, String)>,
    #[serde(flatten)]
    pub systems: BTreeMap<String, Download>,
}

#[derive(Debug, Deserialize)]
pub struct Tools {
    pub cmake: Tool,
    pub ninja: Tool,
}

/// A build tool shipped as a binary inside a PyPI wheel.
#[derive(Debug, Deserialize, Serialize)]
pub struct Tool {
    pub version: String,
    /// Path of the program inside the unpacked wheel.
    pub binary: String,
    #[serde(flatten)]
    pub systems: BTreeMap<String, Download>,
}

impl Pins {
    /// The archives of reference files, by name.
    pub fn reference_archives(&self) -> Result<Vec<(&str, ReferenceArchive)>> {
        self.reference_files
            .iter()
            .filter(|(name, _)| !name.starts_with('_'))
            .map(|(name, value)| {
                let archive = serde_json::from_value(value.clone()).with_context(|| {
                    format!("reference_files.{name} in nix/pins.json is malformed")
                })?;
                Ok((name.as_str(), archive))
            })
            .collect()
    }

    /// Reads and parses a pin file.
    pub fn load(path: &Path) -> Result<Pins> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the pin file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("the pin file {} is malformed", path.display()))
    }

    /// This checkout's pin file.
    pub fn of_checkout() -> Result<Pins> {
        Pins::load(&default_pin_file())
    }

    /// The IREE CMake options of one variant: the common ones, plus the CUDA
    /// ones when `cuda` is set.
    pub fn cmake_options(&self, cuda: bool) -> BTreeMap<String, String> {
        let mut options = self.iree.cmake_options.common.clone();
        if cuda {
            options.extend(self.iree.cmake_options.cuda.clone());
        }
        options
    }
}

/// Picks the entry of a per-system table for `system`, or says which systems
/// the pin file knows.
pub fn for_system<'a>(
    table: &'a BTreeMap<String, Download>,
    system: &str,
    what: &str,
) -> Result<&'a Download> {
    table.get(system).ok_or_else(|| {
        let known: Vec<&str> = table.keys().map(String::as_str).collect();
        anyhow!(
            "nix/pins.json pins no {what} for {system} (it has: {}); add one to build here",
            known.join(", ")
        )
    })
}

/// The repository root (xtask lives in `crates/xtask`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/xtask has two parents")
        .to_path_buf()
}

/// The pin file of this checkout.
pub fn default_pin_file() -> PathBuf {
    repo_root().join("nix").join("pins.json")
}
