//! The mutation suite: link-only regressions the gate must catch. Each one is
//! a small edit to a copy of the tree or of the IREE prefix, and the text its
//! link failure must print. `docs/gate.md` explains what each models.

/// Where a mutation applies.
pub enum Edit {
    /// Replace `from` by `to` in a file of the tree copy (path from the root).
    Tree {
        file: &'static str,
        from: &'static str,
        to: &'static str,
    },
    /// Edit the `Libs:` line of the prefix copy's pkg-config file. Archives
    /// are named by position among the line's static archives (those the
    /// prefix's `lib/` holds), so no archive name is written here.
    Libs(LibsEdit),
}

pub enum LibsEdit {
    /// Remove the archive at this position.
    Drop(usize),
    /// Exchange the archives at these positions.
    Swap(usize, usize),
}

pub struct Mutation {
    pub name: &'static str,
    pub models: &'static str,
    pub edits: &'static [Edit],
    /// The symbol the failing link must report as undefined (GNU ld says
    /// "undefined reference to `SYMBOL'", lld "undefined symbol: SYMBOL").
    pub expect: &'static str,
    /// Only on this architecture (`std::env::consts::ARCH`), if set.
    pub only_arch: Option<&'static str>,
    /// The targets its mutant is checked and linked for.
    pub targets: &'static Targets,
}

/// The targets a mutant is checked and linked for: the smallest set of the
/// link check's targets that links the mutated code and reaches it (a link
/// drops unreached code, and with it the undefined references a mutation
/// makes there). They are built as the link check builds them (release, with
/// the feature the gate's `cuda,xla-iree` turns on in their package), so
/// their failing link is the link check failing, and no other package is
/// rebuilt per mutant.
pub struct Targets {
    /// The package whose targets these are.
    pub package: &'static str,
    /// Cargo's package, feature and target selection.
    pub select: &'static [&'static str],
}

/// kiln-iree's own tests: the shim, the prefix's archives, the instance,
/// devices and flags. Its only dependencies are two small crates, so
/// selecting the package alone (its features resolved for it) costs little.
pub const KILN_IREE: Targets = Targets {
    package: "kiln-iree",
    select: &[
        "--package",
        "kiln-iree",
        "--features",
        "cuda",
        "--all-targets",
    ],
};

/// kiln-xla's `iree_runtime` test: the smallest target that loads a module
/// and calls into it (`Module::invoke`), which kiln-iree's tests do not.
/// Selected within the workspace, with the gate's features, so that its
/// dependencies resolve to the link check's features and are reused.
pub const KILN_XLA_RUNTIME_TEST: Targets = Targets {
    package: "kiln-xla",
    select: &[
        "--workspace",
        "--features",
        "cuda,xla-iree",
        "--test",
        "iree_runtime",
    ],
};

/// The workspace packages a mutant builds: those of every [`Targets`] and the
/// workspace crates they depend on.
pub const MUTANT_BUILT_PACKAGES: &[&str] = &["kiln-core", "kiln-iree", "kiln-xla"];

/// The folder of the package every mutation edits; both target sets link it.
#[cfg(test)]
const MUTATED_PACKAGE_DIR: &str = "crates/kiln-iree/";

const SHIM_C: &str = "crates/kiln-iree/csrc/kiln_iree.c";
const BUILD_RS: &str = "crates/kiln-iree/build.rs";

pub const MUTATIONS: &[Mutation] = &[
    Mutation {
        name: "archive-dropped",
        models: "an archive dropped from the prefix's link description (the second: flatcc's parser)",
        edits: &[Edit::Libs(LibsEdit::Drop(1))],
        expect: "flatcc_verify",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        name: "archives-out-of-order",
        models: "two archives swapped out of dependency order (flatcc before the unified runtime)",
        edits: &[Edit::Libs(LibsEdit::Swap(0, 1))],
        expect: "flatcc_verify",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        name: "printf-archive-dropped",
        models: "the last archive (printf, which IREE formats messages with) left out",
        edits: &[Edit::Libs(LibsEdit::Drop(2))],
        expect: "vsnprintf_",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        name: "shim-calls-unlinked-driver",
        models: "the shim calling into a driver archive that is not linked (Vulkan is not built)",
        edits: &[Edit::Tree {
            file: SHIM_C,
            from: "kiln_iree_error* kiln_iree_instance_create(kiln_iree_instance** out_instance) {\n",
            to: "iree_status_t iree_hal_vulkan_driver_module_register(\n    iree_hal_driver_registry_t* registry);\nkiln_iree_error* kiln_iree_instance_create(kiln_iree_instance** out_instance) {\n  (void)iree_hal_vulkan_driver_module_register(NULL);\n",
        }],
        expect: "iree_hal_vulkan_driver_module_register",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        // Leaving the define out entirely is not link-only for kiln: without
        // it iree/base/allocator.h declares no iree_allocator_system(), and
        // C11 rejects the shim at compile time (cargo check catches it).
        name: "allocator-define-unlinked-impl",
        models: "IREE_ALLOCATOR_SYSTEM_CTL naming an allocator the prefix does not provide",
        edits: &[Edit::Tree {
            file: BUILD_RS,
            from: ".define(\"IREE_ALLOCATOR_SYSTEM_CTL\", \"iree_allocator_libc_ctl\")",
            to: ".define(\"IREE_ALLOCATOR_SYSTEM_CTL\", \"iree_allocator_mimalloc_ctl\")",
        }],
        expect: "iree_allocator_mimalloc_ctl",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        name: "shim-not-linked",
        models: "the shim's static library compiled but not linked",
        edits: &[Edit::Tree {
            file: BUILD_RS,
            from: ".try_compile(\"kiln_iree_shim\")",
            to: ".cargo_metadata(false).try_compile(\"kiln_iree_shim\")",
        }],
        expect: "kiln_iree_",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        name: "shim-symbol-renamed-in-c",
        models: "a shim function renamed on the C side only",
        edits: &[Edit::Tree {
            file: SHIM_C,
            from: "kiln_iree_error* kiln_iree_call_invoke(kiln_iree_call* call) {",
            to: "kiln_iree_error* kiln_iree_call_run(kiln_iree_call* call) {",
        }],
        expect: "kiln_iree_call_invoke",
        only_arch: None,
        targets: &KILN_XLA_RUNTIME_TEST,
    },
    Mutation {
        name: "rust-extern-undefined",
        models: "a Rust extern declaration naming a symbol nobody defines",
        edits: &[
            Edit::Tree {
                file: "crates/kiln-iree/src/ffi.rs",
                from: "include!(concat!(env!(\"OUT_DIR\"), \"/bindings.rs\"));",
                to: "include!(concat!(env!(\"OUT_DIR\"), \"/bindings.rs\"));\nunsafe extern \"C\" {\n    pub fn kiln_iree_instance_reset(instance: *mut kiln_iree_instance);\n}",
            },
            Edit::Tree {
                file: "crates/kiln-iree/src/runtime.rs",
                from: "        unsafe { ffi::kiln_iree_instance_release(self.0.as_ptr()) }",
                to: "        unsafe { ffi::kiln_iree_instance_reset(self.0.as_ptr()) }",
            },
        ],
        expect: "kiln_iree_instance_reset",
        only_arch: None,
        targets: &KILN_IREE,
    },
    Mutation {
        // On aarch64 glibc the stack-protector canary is a global,
        // `__stack_chk_guard`, defined by ld-linux-aarch64.so.1, which libc.so's
        // linker script adds AS_NEEDED: only a reference made before `-lc`
        // marks it needed. rustc ends every link with std's `-lc`, so an extra
        // `-lc` ahead of the archives changes nothing (docs/gate.md, "the
        // `__stack_chk_guard` break"); the break needs stack-protected code
        // *after* the last `-lc`, which is where rustc puts link arguments.
        // x86_64 reads its canary from %fs and links the same mutant fine.
        name: "aarch64-stack-protected-archives-after-libc",
        models: "aarch64 only: stack-protected archives given as link arguments, after rustc's -lc",
        edits: &[
            Edit::Tree {
                file: BUILD_RS,
                from: "        .define(\"_GNU_SOURCE\", None)",
                to: "        .define(\"_GNU_SOURCE\", None)\n        .flag(\"-fstack-protector-all\")",
            },
            Edit::Tree {
                file: BUILD_RS,
                from: "    build.try_compile(\"kiln_iree_shim\")",
                to: "    println!(\"cargo::rustc-link-arg={}/libkiln_iree_shim.a\", std::env::var(\"OUT_DIR\").unwrap());\n    build.cargo_metadata(false).try_compile(\"kiln_iree_shim\")",
            },
            Edit::Tree {
                file: BUILD_RS,
                from: "println!(\"cargo::rustc-link-lib=static:-bundle={name}\");",
                to: "println!(\"cargo::rustc-link-arg={}\", path.display());",
            },
        ],
        expect: "__stack_chk_guard",
        only_arch: Some("aarch64"),
        targets: &KILN_IREE,
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Each edit's text is in its file as committed, once: an edit that no
    /// longer applies is BROKEN at gate time, after the long link check. And
    /// it is in the package the mutants link: a mutant is linked for its
    /// targets only, so an edit outside it would go unlinked and survive for
    /// the wrong reason.
    #[test]
    fn every_edit_applies_once_inside_the_package_a_mutant_links() {
        let root = crate::pins::repo_root();
        for mutation in MUTATIONS {
            for edit in mutation.edits {
                if let Edit::Tree { file, from, .. } = edit {
                    let name = mutation.name;
                    let text = std::fs::read_to_string(root.join(file)).unwrap();
                    let count = text.matches(from).count();
                    assert_eq!(count, 1, "{name}: {file} should hold {from:?} once");
                    let inside = file.starts_with(MUTATED_PACKAGE_DIR);
                    assert!(inside, "{name}: {file} is outside {MUTATED_PACKAGE_DIR}");
                }
            }
        }
    }

    /// Both target sets link the mutated package, with the feature the
    /// gate's features turn on there, and build only the packages the suite
    /// forgets afterwards.
    #[test]
    fn the_mutants_targets_link_the_mutated_package() {
        let root = crate::pins::repo_root();
        let manifest =
            |dir: &str| std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        let root_manifest = manifest(".");
        for (targets, dir) in [
            (&KILN_IREE, MUTATED_PACKAGE_DIR),
            (&KILN_XLA_RUNTIME_TEST, "crates/kiln-xla/"),
        ] {
            let text = manifest(dir);
            assert!(
                text.contains(&format!("name = \"{}\"", targets.package)),
                "{text}"
            );
            assert!(
                text.contains("kiln-iree"),
                "{} does not link kiln-iree",
                targets.package
            );
        }
        // kiln-iree's feature is the one the gate's features turn on there.
        assert!(root_manifest.contains("\"kiln-iree/cuda\""));
        assert_eq!(KILN_IREE.select[3], "cuda");
        for targets in [&KILN_IREE, &KILN_XLA_RUNTIME_TEST] {
            assert!(MUTANT_BUILT_PACKAGES.contains(&targets.package));
        }
        // kiln-xla's workspace dependencies are built with it.
        let kiln_xla = manifest("crates/kiln-xla/");
        for package in ["kiln-core", "kiln-iree"] {
            assert!(
                kiln_xla.contains(&format!("{package}.workspace = true")),
                "{kiln_xla}"
            );
            assert!(MUTANT_BUILT_PACKAGES.contains(&package));
        }
        assert!(
            root.join("crates/kiln-xla/tests/iree_runtime.rs").is_file(),
            "kiln-xla's iree_runtime test was renamed: update KILN_XLA_RUNTIME_TEST"
        );
    }
}
