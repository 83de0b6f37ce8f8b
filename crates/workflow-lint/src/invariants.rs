//! The invariants of `.github/` that zizmor cannot express, checked on the
//! parsed YAML. zizmor (run by the lint, lib.rs, with
//! `.github/zizmor.yml`, auditor persona, every finding fatal) holds the
//! general ones: no `pull_request_target`/`workflow_run` trigger, read-only
//! permissions, actions pinned to a full SHA, `persist-credentials: false`,
//! no `${{ … }}` in a script, secrets only in jobs with an environment, no
//! self-hosted runner (the GPU job's is ignored inline: the guard below holds
//! it), a Dependabot cooldown of a week.
//!
//! These hold kiln's own promises, so that a reviewed change cannot quietly
//! drop a guard (they cannot stop a malicious pull request: it runs its own
//! copy of this file; the repository settings in docs/workflows.md do that):
//! - every pinned action's tag in a comment beside its SHA;
//! - `--locked` on every cargo command that resolves dependencies;
//! - a self-hosted runner only in a job that runs only for pushes to main and
//!   manual runs on main;
//! - secrets and deployment environments only in jobs that run only for
//!   pushes to main (and no secret in a workflow's `env:`);
//! - the cachix CLI given to cachix-action explicitly (`cachixBin`);
//! - a Dependabot file that updates the actions;
//! - no permission to write, anywhere (zizmor passes a write permission
//!   that carries a comment, such as `id-token: write # for OIDC`; kiln's
//!   jobs need none).

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use anyhow::{Context, Result, anyhow};
use saphyr::{LoadableYamlNode, MarkedYamlOwned as Node};

/// The one invariant a finding breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    ActionTag,
    CargoUnlocked,
    SelfHostedRunner,
    SecretOffMain,
    CachixCli,
    Dependabot,
    WritePermission,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::ActionTag => "action-tag",
            Rule::CargoUnlocked => "cargo-unlocked",
            Rule::SelfHostedRunner => "self-hosted-runner",
            Rule::SecretOffMain => "secret-off-main",
            Rule::CachixCli => "cachix-cli",
            Rule::Dependabot => "dependabot",
            Rule::WritePermission => "write-permission",
        }
    }
}

#[derive(Debug)]
pub struct Finding {
    pub file: String,
    pub line: usize,
    pub rule: Rule,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: [{}] {}",
            self.file,
            self.line,
            self.rule.name(),
            self.message
        )
    }
}

/// Events for which GitHub runs only workflow files that are already in this
/// repository: a push (to main, with the `github.ref` guard) and a manual run.
const SELF_HOSTED_EVENTS: [&str; 2] = ["push", "workflow_dispatch"];

/// Secrets and environments: pushes only, so not even a manual run on main
/// can use them.
const SECRET_EVENTS: [&str; 1] = ["push"];

const REF_MAIN: &str = "github.ref == 'refs/heads/main'";

/// Every invariant over a repository's `.github` folder.
pub fn check_repository(root: &Path) -> Result<Vec<Finding>> {
    let dir = root.join(".github/workflows");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .map(|entry| entry.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yml" || e == "yaml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(anyhow!("no workflow files in {}", dir.display()));
    }
    let mut findings = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let name = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        findings.extend(check_workflow(&name, &text)?);
    }
    let dependabot = root.join(".github/dependabot.yml");
    let name = ".github/dependabot.yml";
    match std::fs::read_to_string(&dependabot) {
        Ok(text) => findings.extend(check_dependabot(name, &text)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => findings.push(Finding {
            file: name.into(),
            line: 1,
            rule: Rule::Dependabot,
            message: "missing: nothing keeps the pinned action SHAs current".into(),
        }),
        Err(e) => return Err(anyhow!("cannot read {}: {e}", dependabot.display())),
    }
    Ok(findings)
}

fn parse(file: &str, text: &str) -> Result<Node> {
    let mut docs =
        Node::load_from_str(text).map_err(|e| anyhow!("{file} is not valid YAML: {e}"))?;
    if docs.len() != 1 {
        return Err(anyhow!(
            "{file} holds {} YAML documents; a workflow is one",
            docs.len()
        ));
    }
    Ok(docs.remove(0))
}

/// Collects findings for one file, with the file's source lines at hand for
/// the comments a YAML tree does not keep.
struct Checker<'a> {
    file: &'a str,
    lines: Vec<&'a str>,
    findings: Vec<Finding>,
}

impl Checker<'_> {
    fn report(&mut self, node: &Node, rule: Rule, message: String) {
        self.findings.push(Finding {
            file: self.file.to_string(),
            line: line(node),
            rule,
            message,
        });
    }
}

pub fn check_workflow(file: &str, text: &str) -> Result<Vec<Finding>> {
    let root = parse(file, text)?;
    let mut c = Checker {
        file,
        lines: text.lines().collect(),
        findings: Vec::new(),
    };
    let triggers = triggers(&root);
    check_permissions(&mut c, "the workflow", &root);
    if let Some(env) = get(&root, "env")
        && references_secret(env)
    {
        c.report(
            env,
            Rule::SecretOffMain,
            "a secret in the workflow's `env:` reaches every job; put it in the one job that needs it, inside an environment".into(),
        );
    }
    let jobs = get(&root, "jobs").and_then(|j| j.data.as_mapping());
    for (name, job) in jobs.into_iter().flatten() {
        let name = name.data.as_str().unwrap_or("?");
        check_job(&mut c, &triggers, name, job);
    }
    Ok(c.findings)
}

/// The workflow's trigger events.
fn triggers(root: &Node) -> BTreeSet<String> {
    let Some(on) = get(root, "on") else {
        return BTreeSet::new();
    };
    let events: Vec<String> = if let Some(event) = on.data.as_str() {
        vec![event.into()]
    } else if let Some(list) = on.data.as_vec() {
        list.iter().map(scalar_text).collect()
    } else {
        let map = on.data.as_mapping();
        map.into_iter()
            .flatten()
            .map(|(k, _)| scalar_text(k))
            .collect()
    };
    events.into_iter().collect()
}

/// `holder`'s `permissions:` grant no write: `write-all`, or any scope at
/// `write`, is a finding.
fn check_permissions(c: &mut Checker, holder: &str, node: &Node) {
    let Some(permissions) = get(node, "permissions") else {
        return;
    };
    let mut writes: Vec<String> = Vec::new();
    if scalar_text(permissions) == "write-all" {
        writes.push("write-all".into());
    }
    for (scope, level) in permissions.data.as_mapping().into_iter().flatten() {
        if scalar_text(level) == "write" {
            writes.push(format!("{}: write", scalar_text(scope)));
        }
    }
    if !writes.is_empty() {
        c.report(
            permissions,
            Rule::WritePermission,
            format!(
                "{holder} asks for `{}`; kiln's jobs write nothing to GitHub, so every permission is `read` or `none`",
                writes.join("`, `")
            ),
        );
    }
}

fn check_job(c: &mut Checker, triggers: &BTreeSet<String>, name: &str, job: &Node) {
    check_permissions(c, &format!("job `{name}`"), job);
    if let Some(uses) = get(job, "uses") {
        check_tag(c, uses);
    }
    let steps = get(job, "steps").and_then(|s| s.data.as_vec());
    for step in steps.into_iter().flatten() {
        check_step(c, step);
    }

    let guard = JobGuard::of(job, triggers);
    if let Some(runs_on) = get(job, "runs-on")
        && may_be_self_hosted(job, runs_on)
        && let Err(missing) = guard.main_only(&SELF_HOSTED_EVENTS)
    {
        c.report(
            runs_on,
            Rule::SelfHostedRunner,
            format!(
                "job `{name}` may run on a self-hosted runner but {missing}; it must run only for pushes to main and manual runs on main (no pull_request trigger in its workflow, and `if: … && {REF_MAIN}`)"
            ),
        );
    }
    let environment = get(job, "environment");
    if (environment.is_some() || references_secret(job))
        && let Err(missing) = guard.main_only(&SECRET_EVENTS)
    {
        let what = if environment.is_some() {
            "a deployment environment"
        } else {
            "a secret"
        };
        c.report(
            environment.unwrap_or(job),
            Rule::SecretOffMain,
            format!(
                "job `{name}` uses {what} but {missing}; it must run only for pushes to main (`if: github.event_name == 'push' && {REF_MAIN}`)"
            ),
        );
    }
}

fn check_step(c: &mut Checker, step: &Node) {
    if let Some(uses) = get(step, "uses") {
        check_tag(c, uses);
        let action = uses.data.as_str().unwrap_or_default();
        let with = get(step, "with");
        if action.starts_with("cachix/cachix-action@")
            && with.and_then(|w| get(w, "cachixBin")).is_none()
        {
            c.report(
                uses,
                Rule::CachixCli,
                "cachix-action without `cachixBin` installs the cachix CLI from an unpinned remote expression; build it from the flake's nixpkgs and pass its path".into(),
            );
        }
    }
    if let Some(run) = get(step, "run") {
        check_cargo_locked(c, run);
    }
}

/// Cargo subcommands that resolve dependencies, and so would rewrite a stale
/// Cargo.lock instead of failing without `--locked`.
const CARGO_RESOLVING: [&str; 9] = [
    "build", "check", "clippy", "doc", "install", "nextest", "run", "test", "bench",
];

fn check_cargo_locked(c: &mut Checker, run: &Node) {
    let script = scalar_text(run);
    for command in script.lines() {
        let words: Vec<&str> = command.split_whitespace().collect();
        let unlocked = words
            .windows(2)
            .any(|pair| pair[0] == "cargo" && CARGO_RESOLVING.contains(&pair[1]))
            && !words.contains(&"--locked");
        if unlocked {
            c.report(
                run,
                Rule::CargoUnlocked,
                format!(
                    "`{}` without `--locked` would rewrite a stale Cargo.lock instead of failing",
                    command.trim()
                ),
            );
        }
    }
}

/// `uses: owner/repo[/path]@<SHA> # <tag>`: the tag a reviewer reads (that
/// the SHA is a full one is zizmor's `unpinned-uses`). A local action or
/// workflow (`./…`) and a Docker image have no tag.
fn check_tag(c: &mut Checker, uses: &Node) {
    let target = scalar_text(uses);
    if target.starts_with("./") || target.starts_with("docker://") {
        return;
    }
    let source_line = c.lines.get(line(uses).saturating_sub(1)).copied();
    let tag = source_line
        .and_then(|l| l.split_once(target.as_str()))
        .and_then(|(_, rest)| rest.trim_start().strip_prefix('#'))
        .map(str::trim)
        .unwrap_or_default();
    if tag.is_empty() {
        c.report(
            uses,
            Rule::ActionTag,
            format!(
                "`{target}` has no `# <tag>` comment: a reviewer (and Dependabot) cannot tell which release the SHA is"
            ),
        );
    }
}

/// What a job's `if:` and its workflow's triggers allow.
struct JobGuard {
    /// The events the job can run for.
    events: BTreeSet<String>,
    /// Whether the `if:` requires `github.ref == 'refs/heads/main'`.
    ref_main: bool,
}

impl JobGuard {
    fn of(job: &Node, triggers: &BTreeSet<String>) -> JobGuard {
        let conjuncts = get(job, "if")
            .map(|c| required_conditions(&scalar_text(c)))
            .unwrap_or_default();
        let mut events = triggers.clone();
        for condition in &conjuncts {
            if let Some(event) = condition
                .strip_prefix("github.event_name=='")
                .and_then(|rest| rest.strip_suffix('\''))
                .filter(|e| e.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
            {
                events.retain(|e| e == event);
            }
        }
        JobGuard {
            events,
            ref_main: conjuncts.contains(&squeeze(REF_MAIN)),
        }
    }

    /// Ok if the job runs only on main and only for `allowed` events; else
    /// what is missing, in words.
    fn main_only(&self, allowed: &[&str]) -> std::result::Result<(), String> {
        let extra: Vec<&str> = self
            .events
            .iter()
            .map(String::as_str)
            .filter(|e| !allowed.contains(e))
            .collect();
        match (extra.is_empty(), self.ref_main) {
            (true, true) => Ok(()),
            (true, false) => Err(format!("its `if:` does not require `{REF_MAIN}`")),
            (false, _) => Err(format!(
                "it can also run for `{}` (a workflow trigger its `if:` does not exclude)",
                extra.join("`, `")
            )),
        }
    }
}

/// The conditions that an `if:` expression requires: its top-level `&&`
/// operands, each with the whitespace outside quotes removed and redundant
/// outer parentheses dropped. An expression with a top-level `||` (or that
/// does not parse into balanced parts) requires nothing.
fn required_conditions(expression: &str) -> Vec<String> {
    let expr = expression.trim();
    let expr = expr
        .strip_prefix("${{")
        .and_then(|e| e.strip_suffix("}}"))
        .unwrap_or(expr);
    let squeezed = squeeze(expr);
    let mut parts = Vec::new();
    let (mut depth, mut quoted, mut start) = (0i32, false, 0);
    let bytes = squeezed.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' => quoted = !quoted,
            b'(' if !quoted => depth += 1,
            b')' if !quoted => depth -= 1,
            b'|' if !quoted && depth == 0 && bytes.get(i + 1) == Some(&b'|') => return Vec::new(),
            b'&' if !quoted && depth == 0 && bytes.get(i + 1) == Some(&b'&') => {
                parts.push(squeezed[start..i].to_string());
                start = i + 2;
                i += 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Vec::new();
        }
        i += 1;
    }
    if depth != 0 || quoted {
        return Vec::new();
    }
    parts.push(squeezed[start..].to_string());
    parts
        .into_iter()
        .map(|p| strip_parens(&p).to_string())
        .collect()
}

/// `(a)` → `a` when the parentheses enclose the whole operand.
fn strip_parens(mut s: &str) -> &str {
    while let Some(inner) = s.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
        let mut depth = 0;
        let encloses = inner.chars().all(|ch| {
            match ch {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            depth >= 0
        });
        if !encloses {
            break;
        }
        s = inner;
    }
    s
}

/// The text without whitespace outside single-quoted strings.
fn squeeze(text: &str) -> String {
    let mut quoted = false;
    text.chars()
        .filter(|&ch| {
            if ch == '\'' {
                quoted = !quoted;
            }
            quoted || !ch.is_whitespace()
        })
        .collect()
}

/// Whether the job may run on a self-hosted runner: any label that is not a
/// GitHub-hosted image, a runner group, or an expression that does not
/// resolve to such labels through the job's matrix.
fn may_be_self_hosted(job: &Node, runs_on: &Node) -> bool {
    if runs_on.data.as_mapping().is_some() {
        return true;
    }
    let labels: Vec<String> = match runs_on.data.as_vec() {
        Some(list) => list.iter().map(scalar_text).collect(),
        None => vec![scalar_text(runs_on)],
    };
    labels.iter().any(|label| {
        let Some(key) = matrix_reference(label) else {
            return !is_github_hosted(label);
        };
        let values = matrix_values(job, &key);
        values.is_empty() || values.iter().any(|v| !is_github_hosted(v))
    })
}

fn is_github_hosted(label: &str) -> bool {
    ["ubuntu-", "windows-", "macos-"]
        .iter()
        .any(|prefix| label.starts_with(prefix))
        && !label.contains("${{")
}

/// `${{ matrix.NAME }}` → `NAME`.
fn matrix_reference(label: &str) -> Option<String> {
    let inner = label.trim().strip_prefix("${{")?.strip_suffix("}}")?.trim();
    let key = inner.strip_prefix("matrix.")?;
    key.chars()
        .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
        .then(|| key.to_string())
}

/// Every value `matrix.key` can take: its list and its `include` entries.
fn matrix_values(job: &Node, key: &str) -> Vec<String> {
    let Some(matrix) = get(job, "strategy").and_then(|s| get(s, "matrix")) else {
        return Vec::new();
    };
    let mut values: Vec<String> = get(matrix, key)
        .and_then(|v| v.data.as_vec())
        .into_iter()
        .flatten()
        .map(scalar_text)
        .collect();
    let includes = get(matrix, "include").and_then(|i| i.data.as_vec());
    for entry in includes.into_iter().flatten() {
        match get(entry, key) {
            Some(v) => values.push(scalar_text(v)),
            None => return Vec::new(),
        }
    }
    values
}

/// Whether any string under `node` reads a secret (the `secrets` context in
/// an expression: `secrets.NAME`, `secrets['NAME']`, `toJSON(secrets)`; or a
/// reusable workflow's `secrets: inherit`).
fn references_secret(node: &Node) -> bool {
    if let Some(map) = node.data.as_mapping() {
        return map.iter().any(|(k, v)| {
            (k.data.as_str() == Some("secrets") && v.data.as_str() == Some("inherit"))
                || references_secret(v)
        });
    }
    if let Some(list) = node.data.as_vec() {
        return list.iter().any(references_secret);
    }
    let text = scalar_text(node);
    text.split("${{").skip(1).any(|expr| {
        let expr = expr.split("}}").next().unwrap_or_default();
        let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        expr.match_indices("secrets").any(|(at, word)| {
            let before = expr[..at].chars().next_back();
            let after = expr[at + word.len()..].chars().next();
            !before.is_some_and(is_name) && !after.is_some_and(is_name)
        })
    })
}

pub fn check_dependabot(file: &str, text: &str) -> Result<Vec<Finding>> {
    let root = parse(file, text)?;
    let mut c = Checker {
        file,
        lines: Vec::new(),
        findings: Vec::new(),
    };
    let updates = get(&root, "updates").and_then(|u| u.data.as_vec());
    let actions = updates.into_iter().flatten().find(|u| {
        get(u, "package-ecosystem").map(scalar_text).as_deref() == Some("github-actions")
    });
    // Its cooldown is zizmor's `dependabot-cooldown` (.github/zizmor.yml).
    if actions.is_none() {
        c.report(
            &root,
            Rule::Dependabot,
            "no `package-ecosystem: github-actions` update: nothing keeps the pinned action SHAs current".into(),
        );
    }
    Ok(c.findings)
}

fn get<'a>(node: &'a Node, key: &str) -> Option<&'a Node> {
    node.data.as_mapping_get(key)
}

fn line(node: &Node) -> usize {
    node.span.start.line()
}

/// A scalar's text as written (`true` → "true", `7` → "7"); empty for
/// collections.
fn scalar_text(node: &Node) -> String {
    if let Some(s) = node.data.as_str() {
        return s.to_string();
    }
    if let Some(b) = node.data.as_bool() {
        return b.to_string();
    }
    if let Some(i) = node.data.as_integer() {
        return i.to_string();
    }
    if let Some(f) = node.data.as_floating_point() {
        return f.to_string();
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo_root;

    #[test]
    fn this_repository_holds_every_invariant() {
        let findings = check_repository(&repo_root()).unwrap();
        let text: Vec<String> = findings.iter().map(ToString::to_string).collect();
        assert!(findings.is_empty(), "{}", text.join("\n"));
    }

    #[test]
    fn if_conditions() {
        assert_eq!(
            required_conditions(
                "${{ (github.event_name == 'push') && github.ref == 'refs/heads/main' }}"
            ),
            ["github.event_name=='push'", "github.ref=='refs/heads/main'"]
        );
        assert!(required_conditions("a && b || c").is_empty());
        assert_eq!(required_conditions("(a || b) && c"), ["a||b", "c"]);
        assert_eq!(required_conditions("x == 'a && b'"), ["x=='a && b'"]);
        assert!(required_conditions("(a && b").is_empty());
        // A disjunction inside parentheses narrows nothing.
        let job = Node::load_from_str(
            "if: (github.event_name == 'push' || github.event_name == 'pull_request') && github.ref == 'refs/heads/main'\n",
        )
        .unwrap()
        .remove(0);
        let triggers = ["pull_request".to_string(), "push".to_string()].into();
        assert!(
            JobGuard::of(&job, &triggers)
                .main_only(&SECRET_EVENTS)
                .is_err()
        );
    }

    #[test]
    fn bad_yaml_is_an_error_that_names_the_file() {
        let error = check_workflow("w.yml", "on: [push\n").unwrap_err();
        assert!(
            error.to_string().contains("w.yml is not valid YAML"),
            "{error}"
        );
        let error = check_workflow("w.yml", "on: push\non: pull_request\n").unwrap_err();
        assert!(error.to_string().contains("w.yml"), "{error}");
    }
}
