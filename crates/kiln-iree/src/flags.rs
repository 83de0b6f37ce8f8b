//! IREE's process-wide runtime flags, set safely.
//!
//! IREE's flag parser keeps pointers into the text it parses (string and list
//! flags) and writes NULs into it, reads integers with `atoi` (so
//! `notanumber` is 0), appends list flags on every parse, and exits the
//! process on action flags (`--help`, `--dump_task_topologies`) or reads
//! files (`--flagfile`). So kiln:
//! - validates every flag against the types IREE's own flag listing shows
//!   before anything is parsed, and rejects action flags;
//! - keeps the parsed text in [`FLAGS`] for the life of the process;
//! - parses under the same lock that device creation takes, and only while
//!   no device exists (a device reads the flags when it is created);
//! - restores the defaults of flags the previous call set, and refuses to
//!   change a list flag once given (IREE cannot clear one).

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result, check_raw};
use crate::ffi;

/// A flag's type, as IREE's listing prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Bool,
    Int,
    Float,
    /// A string flag and its default (unquoted).
    Str,
    /// A list of strings: each occurrence appends.
    List,
    /// A flag that does something when parsed (prints, reads a file, exits).
    Action,
}

/// Every registered flag, its kind and default, from IREE's listing before
/// any flag was parsed.
#[derive(Debug)]
pub(crate) struct Registry {
    flags: BTreeMap<String, (Kind, String)>,
}

impl Registry {
    /// Reads IREE's listing (`iree_flags_dump`): `--name=value` for scalar
    /// flags (strings quoted), `# --name=...` for an empty list, and
    /// `# --name` or `# --name=[path]` for action flags.
    pub(crate) fn from_listing(text: &str) -> Registry {
        let mut flags = BTreeMap::new();
        for line in text.lines() {
            let (commented, rest) = match line.strip_prefix("# --") {
                Some(rest) => (true, rest),
                None => match line.strip_prefix("--") {
                    Some(rest) => (false, rest),
                    None => continue,
                },
            };
            let (name, value) = rest.split_once('=').unwrap_or((rest, ""));
            let (kind, default) = if commented {
                if value == "..." {
                    (Kind::List, String::new())
                } else {
                    (Kind::Action, String::new())
                }
            } else if value == "true" || value == "false" {
                (Kind::Bool, value.to_string())
            } else if let Some(s) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                (Kind::Str, s.to_string())
            } else if value.parse::<i64>().is_ok() {
                (Kind::Int, value.to_string())
            } else if value.parse::<f64>().is_ok() {
                (Kind::Float, value.to_string())
            } else {
                // A callback flag printing its own way: not a plain value.
                (Kind::Action, String::new())
            };
            flags.insert(name.to_string(), (kind, default));
        }
        Registry { flags }
    }

    /// The registry of the linked IREE runtime (read under the lock).
    fn of_runtime() -> Result<Registry> {
        Ok(Registry::from_listing(&read_listing()?))
    }

    /// Checks one flag as the user wrote it; returns its name and kind.
    pub(crate) fn check(&self, flag: &str) -> Result<(String, Kind)> {
        let bad = |why: String| Error::Flag {
            flag: flag.to_string(),
            why,
        };
        // IREE trims the argument and the name; so do we, to judge the same text.
        let Some(body) = flag.trim().strip_prefix("--") else {
            return Err(bad("an IREE flag is written --name=value".into()));
        };
        let (name, value) = match body.split_once('=') {
            Some((name, value)) => (name.trim(), Some(value.trim())),
            None => (body.trim(), None),
        };
        let Some((kind, _)) = self.flags.get(name) else {
            return Err(bad(format!(
                "flag '{name}' not recognized by this IREE runtime"
            )));
        };
        let valid = match (kind, value) {
            (Kind::Action, _) => {
                return Err(bad(format!(
                    "--{name} is an action of IREE's own tools (it prints, reads a file or \
                     exits the process); kiln does not take it"
                )));
            }
            (Kind::Bool, None) => true,
            (_, None) => false,
            (Kind::Bool, Some(v)) => ["true", "false", "1", "0"].contains(&v),
            // IREE reads integers with atoi: only i32 values round-trip.
            (Kind::Int, Some(v)) => v.parse::<i32>().is_ok(),
            (Kind::Float, Some(v)) => v.parse::<f64>().is_ok_and(f64::is_finite),
            (Kind::Str | Kind::List, Some(_)) => true,
        };
        if !valid {
            let expected = match kind {
                Kind::Bool => "true, false, 1 or 0",
                Kind::Int => "an integer from -2147483648 to 2147483647",
                Kind::Float => "a finite number",
                _ => "a value after '='",
            };
            return Err(bad(format!("--{name} takes {expected}")));
        }
        Ok((name.to_string(), kind.clone()))
    }

    fn default_of(&self, name: &str) -> &str {
        self.flags.get(name).map_or("", |(_, default)| default)
    }
}

/// The process's flag state; IREE's flag globals are only touched under it.
pub(crate) struct FlagState {
    registry: Option<Registry>,
    /// Every string IREE parsed: it keeps pointers into them forever.
    text: Vec<Box<[u8]>>,
    /// The flags in effect (beyond IREE's defaults), as given.
    current: Vec<String>,
    /// List flags given so far (IREE cannot clear them).
    lists: Vec<(String, String)>,
    /// Devices alive: while any is, the flags cannot change.
    pub(crate) live_devices: usize,
}

static FLAGS: Mutex<FlagState> = Mutex::new(FlagState {
    registry: None,
    text: Vec::new(),
    current: Vec::new(),
    lists: Vec::new(),
    live_devices: 0,
});

/// The flag state, locked. Device creation and release take it too.
pub(crate) fn lock() -> MutexGuard<'static, FlagState> {
    // The state stays consistent across a panic (it is updated last).
    FLAGS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sets IREE runtime flags as IREE's tools take them
/// (`--cuda_use_streams=false`), replacing those of the previous call. They
/// are process-wide and configure devices opened afterwards, so they cannot
/// change while a device exists. Unknown flags, invalid values, action flags
/// (`--help`, `--flagfile`) and a change to a list flag already given are
/// errors; nothing is applied then.
pub fn set_flags(flags: &[&str]) -> Result<()> {
    let mut state = lock();
    if state.current == flags {
        return Ok(());
    }
    if state.live_devices > 0 {
        return Err(Error::FlagsInUse {
            current: state.current.join(" "),
            requested: flags.join(" "),
        });
    }
    if state.registry.is_none() {
        state.registry = Some(Registry::of_runtime()?);
    }
    let registry = state.registry.as_ref().expect("set above");
    let mut checked = Vec::with_capacity(flags.len());
    for flag in flags {
        if flag.contains('\0') {
            return Err(Error::Nul {
                what: "an IREE flag",
                value: flag.to_string(),
            });
        }
        checked.push((registry.check(flag)?, *flag));
    }
    // A list flag appends on every parse: one given earlier cannot be
    // replaced, only repeated exactly.
    let lists: Vec<(String, String)> = checked
        .iter()
        .filter(|((_, kind), _)| *kind == Kind::List)
        .map(|((name, _), flag)| (name.clone(), flag.trim().to_string()))
        .collect();
    if !state.lists.is_empty() && lists != state.lists {
        return Err(Error::Flag {
            flag: flags.join(" "),
            why: format!(
                "IREE list flags cannot be changed once given in a process (given: {})",
                state
                    .lists
                    .iter()
                    .map(|(_, f)| f.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        });
    }
    // Restore the defaults of the scalar flags the previous call set, then
    // apply these (a later occurrence wins).
    let mut to_parse: Vec<String> = Vec::new();
    for previous in &state.current {
        if let Ok((name, kind)) = registry.check(previous)
            && kind != Kind::List
        {
            to_parse.push(format!("--{name}={}", registry.default_of(&name)));
        }
    }
    let lists_already_parsed = !state.lists.is_empty();
    for ((_, kind), flag) in &checked {
        if *kind == Kind::List && lists_already_parsed {
            continue;
        }
        to_parse.push(flag.to_string());
    }
    let mut text: Vec<Box<[u8]>> = to_parse
        .iter()
        .map(|f| {
            let mut bytes = f.clone().into_bytes();
            bytes.push(0);
            bytes.into_boxed_slice()
        })
        .collect();
    let pointers: Vec<*mut std::ffi::c_char> =
        text.iter_mut().map(|t| t.as_mut_ptr().cast()).collect();
    // SAFETY: each pointer is a NUL-terminated, mutable string that moves
    // into `state.text` below and is never freed, moved or read by Rust
    // again: IREE may keep pointers into it and write into it. We hold the
    // lock, and no device exists, so nothing in IREE reads the flags now.
    let result = check_raw(unsafe { ffi::kiln_iree_set_flags(pointers.len(), pointers.as_ptr()) });
    // Kept whatever happened: IREE may have stored pointers before failing.
    state.text.append(&mut text);
    result?;
    state.current = flags.iter().map(|f| f.to_string()).collect();
    state.lists = lists;
    Ok(())
}

/// IREE's listing of its flags with the values in effect, one per line
/// (`--name=value`), as IREE's tools print it with `--help`.
pub fn flags_in_effect() -> Result<String> {
    let _state = lock();
    read_listing()
}

/// The listing, read through the shim.
fn read_listing() -> Result<String> {
    let mut text = std::ptr::null_mut();
    let mut length = 0usize;
    // SAFETY: both out-pointers are valid; on success `text` holds `length`
    // bytes owned by the shim, freed below exactly once.
    unsafe {
        check_raw(ffi::kiln_iree_flags_dump(&mut text, &mut length))?;
        let Some(text) = NonNull::new(text) else {
            return Ok(String::new());
        };
        let bytes = std::slice::from_raw_parts(text.as_ptr().cast::<u8>(), length);
        let listing = String::from_utf8_lossy(bytes).into_owned();
        ffi::kiln_iree_text_free(text.as_ptr());
        Ok(listing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = "\
--task_worker_stack_size=131072
--task_topology_mode=\"physical_cores\"
--task_topology_favor=\"\"
# --task_topology_cpu_ids=...
--cuda_use_streams=true
--ratio=0.5
# --help
# --flagfile=[path]
# --dump_task_topologies
";

    fn check(flag: &str) -> std::result::Result<Kind, String> {
        Registry::from_listing(LISTING)
            .check(flag)
            .map(|(_, kind)| kind)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_listing_gives_each_flag_its_kind_and_default() {
        let r = Registry::from_listing(LISTING);
        assert_eq!(r.flags["task_worker_stack_size"].0, Kind::Int);
        assert_eq!(
            r.flags["task_topology_mode"],
            (Kind::Str, "physical_cores".into())
        );
        assert_eq!(r.flags["task_topology_favor"], (Kind::Str, String::new()));
        assert_eq!(r.flags["task_topology_cpu_ids"].0, Kind::List);
        assert_eq!(r.flags["cuda_use_streams"].0, Kind::Bool);
        assert_eq!(r.flags["ratio"].0, Kind::Float);
        for action in ["help", "flagfile", "dump_task_topologies"] {
            assert_eq!(r.flags[action].0, Kind::Action, "{action}");
        }
    }

    #[test]
    fn valid_flags_pass() {
        assert_eq!(check("--task_worker_stack_size=65536"), Ok(Kind::Int));
        assert_eq!(check(" --cuda_use_streams = 0 "), Ok(Kind::Bool));
        assert_eq!(check("--cuda_use_streams"), Ok(Kind::Bool));
        assert_eq!(check("--task_topology_mode=\"x\""), Ok(Kind::Str));
        assert_eq!(check("--task_topology_cpu_ids=0,1"), Ok(Kind::List));
        assert_eq!(check("--ratio=1e-3"), Ok(Kind::Float));
    }

    #[test]
    fn invalid_values_and_action_flags_are_errors() {
        let cases = [
            ("--task_worker_stack_size=notanumber", "an integer"),
            ("--task_worker_stack_size=99999999999", "an integer"),
            ("--task_worker_stack_size", "an integer"),
            ("--cuda_use_streams=yes", "true, false, 1 or 0"),
            ("--ratio=nan", "a finite number"),
            ("--help", "kiln does not take it"),
            ("--flagfile=/etc/passwd", "kiln does not take it"),
            ("--dump_task_topologies", "kiln does not take it"),
            ("--no_such_flag=1", "not recognized"),
            ("task_worker_stack_size=1", "--name=value"),
        ];
        for (flag, expected) in cases {
            let error = check(flag).unwrap_err();
            assert!(error.contains(expected), "{flag}: {error}");
            assert!(error.contains(flag.trim()), "{flag}: {error}");
        }
    }
}
