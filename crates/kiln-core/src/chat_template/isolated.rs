//! Rendering a chat template in a child process, so that a template that
//! crashes, floods memory or never ends cannot take the process that serves
//! with it.
//!
//! The render is bounded in steps, memory and output and runs on a large
//! stack of its own, but minijinja lets a template put a namespace inside
//! its own attribute (`{% set ns.x = [ns] %}`), and printing or comparing
//! such a value recurses until any stack overflows: an abort, not an error.
//! And some of its operations build what they are asked for before any fuel
//! is charged: concatenating a list to itself in a loop (`{% set ns.l =
//! ns.l + ns.l %}`) is lazy until its nesting passes a depth, then copies
//! 2^depth items in one step. So the child is the bound that holds whatever
//! the template does: it is killed at its time limit or the caller's
//! deadline, whichever comes first (its reply is read on a thread of its
//! own, so the clock runs while it writes); it gets its request as an
//! in-memory file, not a pipe, so a child that dies early cannot raise
//! SIGPIPE in a caller that does not ignore it (a C `main`, a fuzzer); it
//! runs under an address-space
//! and a CPU-time limit; and it dies with the thread that started it
//! (`PR_SET_PDEATHSIG`), so no renderer outlives a killed server.
//!
//! The child is this same executable (`/proc/self/exe`), told by
//! [`CHILD_ENV`] to render one request from its standard input and exit; a
//! program that renders this way calls [`serve_child_if_asked`] first thing
//! in `main`.

use std::io::{Read, Seek, Write};
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{ChatTemplate, MAX_RENDERED_BYTES, Message, RENDER_STACK_BYTES, UNUSABLE};
use crate::error::{Error, Result};

/// Set in the child's environment: render the request on stdin, then exit.
pub const CHILD_ENV: &str = "KILN_CHAT_TEMPLATE_CHILD";
/// The longest a render may take: its fuel bounds real templates to
/// milliseconds; this bounds the ones that build before they are charged,
/// each of which holds a core until it ends.
pub const RENDER_TIME_LIMIT: Duration = Duration::from_secs(3);
/// The child's address space beyond its render stack (which is reserved,
/// not used): the executable, its libraries, the heap's arenas and the
/// values a template builds. A render that needs more fails to allocate and
/// its child aborts; real templates use a few MiB.
pub const RENDER_MEMORY_LIMIT: u64 = 1 << 30;

/// Whether this executable can serve as its own renderer: set by
/// [`serve_child_if_asked`], which such a program calls first in `main`.
static CAN_RENDER_IN_CHILD: AtomicBool = AtomicBool::new(false);

#[derive(Serialize, Deserialize)]
struct Request {
    source: String,
    origin: String,
    bos_token: String,
    eos_token: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    Rendered(String),
    /// The template cannot be used (its own fault).
    Refused(String),
    /// The template rejected the conversation (`raise_exception`).
    Rejected(String),
}

/// In the child (when [`CHILD_ENV`] is set): renders the request on
/// standard input, writes the reply to standard output and exits. Elsewhere
/// it records that this executable can be its own renderer and returns.
pub fn serve_child_if_asked() {
    if std::env::var_os(CHILD_ENV).is_none() {
        CAN_RENDER_IN_CHILD.store(true, Ordering::Relaxed);
        return;
    }
    let mut input = Vec::new();
    let read = std::io::stdin()
        .take((MAX_RENDERED_BYTES as u64) * 64)
        .read_to_end(&mut input);
    let reply = match read
        .ok()
        .and_then(|_| serde_json::from_slice::<Request>(&input).ok())
    {
        None => Reply::Refused("the renderer got no readable request".into()),
        Some(request) => {
            let messages = request.messages;
            let rendered = ChatTemplate::new(
                &request.origin,
                &request.source,
                &request.bos_token,
                &request.eos_token,
            )
            .and_then(|template| template.render(&messages, request.add_generation_prompt));
            match rendered {
                Ok(text) => Reply::Rendered(text),
                Err(Error::ChatTemplate { message, .. }) => Reply::Refused(message),
                Err(Error::ConversationRejected { message, .. }) => Reply::Rejected(message),
                Err(other) => Reply::Refused(other.to_string()),
            }
        }
    };
    let mut out = std::io::stdout().lock();
    let written = serde_json::to_writer(&mut out, &reply).is_ok() && out.flush().is_ok();
    std::process::exit(if written { 0 } else { 1 });
}

impl ChatTemplate {
    /// [`ChatTemplate::render`], bounded whatever the template does: in a
    /// child process (see the module) when this executable can be one,
    /// within [`RENDER_TIME_LIMIT`]; in this process otherwise (a test
    /// binary, a library user), where fuel and the output bound are the
    /// only limits.
    pub fn render_bounded(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        if CAN_RENDER_IN_CHILD.load(Ordering::Relaxed) {
            self.render_isolated(messages, add_generation_prompt)
        } else {
            self.render(messages, add_generation_prompt)
        }
    }

    /// [`ChatTemplate::render`] in a child process (see the module), within
    /// [`RENDER_TIME_LIMIT`].
    pub fn render_isolated(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_in_child(messages, add_generation_prompt, None)
    }

    /// [`ChatTemplate::render`] in a child process (see the module): the
    /// same prompt or the same error, and an error, never a crash or a
    /// hang, when the template crashes its renderer, outgrows its memory or
    /// runs past [`RENDER_TIME_LIMIT`] or `deadline`, whichever comes first.
    /// The calling thread must outlive the render (it does: this waits for
    /// the child), since the child dies with it.
    pub fn render_isolated_until(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        deadline: Instant,
    ) -> Result<String> {
        self.render_in_child(messages, add_generation_prompt, Some(deadline))
    }

    fn render_in_child(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        deadline: Option<Instant>,
    ) -> Result<String> {
        let failed = |message: String| Error::ChatTemplate {
            origin: self.origin.clone(),
            message,
        };
        let limit = Instant::now() + RENDER_TIME_LIMIT;
        let (deadline, limited_by) = match deadline {
            Some(deadline) if deadline < limit => (deadline, "the request's deadline"),
            _ => (limit, "kiln's limit for a render"),
        };
        let request = serde_json::to_vec(&Request {
            source: self.source.clone(),
            origin: self.origin.clone(),
            bos_token: self.bos_token.clone(),
            eos_token: self.eos_token.clone(),
            messages: messages.to_vec(),
            add_generation_prompt,
        })
        .map_err(|e| failed(format!("cannot hand it to its renderer: {e}")))?;
        let request = request_file(&request)
            .map_err(|e| failed(format!("cannot hand it to its renderer: {e}")))?;
        let parent = std::process::id();
        let mut command = Command::new("/proc/self/exe");
        command
            .env(CHILD_ENV, "1")
            .stdin(Stdio::from(request))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: `limit_child` makes only async-signal-safe system calls
        // and allocates nothing, as code between fork and exec must.
        unsafe { command.pre_exec(move || limit_child(parent)) };
        let mut child = command
            .spawn()
            .map_err(|e| failed(format!("cannot start its renderer: {e}")))?;
        // Read on a thread of its own: the clock below runs whatever the
        // child does with its pipe.
        let mut stdout = child.stdout.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut output = Vec::new();
            (&mut stdout)
                .take((MAX_RENDERED_BYTES as u64) * 8)
                .read_to_end(&mut output)
                .map(|_| output)
        });
        let status = wait_until(&mut child, deadline);
        // The child has exited or been killed: its pipe is closed.
        let output = reader.join();
        let status = match status {
            Ok(Some(status)) => status,
            Ok(None) => {
                let seconds = RENDER_TIME_LIMIT.as_secs();
                return Err(failed(format!(
                    "rendering it did not finish within {limited_by} ({seconds} s at most); \
                     its renderer was stopped{UNUSABLE}"
                )));
            }
            Err(e) => return Err(failed(format!("its renderer did not finish: {e}"))),
        };
        if !status.success() {
            let mib = RENDER_MEMORY_LIMIT >> 20;
            return Err(failed(format!(
                "rendering it crashed its renderer ({status}: more than its {mib} MiB of memory, \
                 a value that contains itself, or another abort){UNUSABLE}"
            )));
        }
        let output = match output {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Err(failed(format!("cannot read its renderer's reply: {e}"))),
            Err(_) => return Err(failed("the thread reading its renderer failed".into())),
        };
        match serde_json::from_slice::<Reply>(&output) {
            Ok(Reply::Rendered(text)) => Ok(text),
            Ok(Reply::Refused(message)) => Err(failed(message)),
            Ok(Reply::Rejected(message)) => Err(Error::ConversationRejected {
                origin: self.origin.clone(),
                message,
            }),
            Err(e) => Err(failed(format!("its renderer's reply is unreadable: {e}"))),
        }
    }
}

/// `request` in an anonymous in-memory file, read from its start.
fn request_file(request: &[u8]) -> std::io::Result<std::fs::File> {
    // SAFETY: a NUL-terminated name and plain flags.
    let fd = unsafe { libc::memfd_create(c"kiln-render-request".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened that nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(request)?;
    file.seek(std::io::SeekFrom::Start(0))?;
    Ok(file)
}

/// In the child, between fork and exec: die with the thread that started
/// it (and at once if that already happened), and limit its address space
/// and CPU time.
fn limit_child(parent: u32) -> std::io::Result<()> {
    let check = |result: libc::c_int| match result {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    };
    let address_space = (RENDER_STACK_BYTES as u64 + RENDER_MEMORY_LIMIT) as libc::rlim_t;
    let cpu_seconds = RENDER_TIME_LIMIT.as_secs() as libc::rlim_t;
    // SAFETY: plain system calls on values of this frame.
    unsafe {
        check(libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ))?;
        if libc::getppid() as u32 != parent {
            return Err(std::io::Error::other(
                "the server ended before its renderer started",
            ));
        }
        check(libc::setrlimit(
            libc::RLIMIT_AS,
            &libc::rlimit {
                rlim_cur: address_space,
                rlim_max: address_space,
            },
        ))?;
        check(libc::setrlimit(
            libc::RLIMIT_CPU,
            &libc::rlimit {
                rlim_cur: cpu_seconds,
                rlim_max: cpu_seconds + 1,
            },
        ))?;
    }
    Ok(())
}

/// Waits for `child` until `deadline`; kills and reaps it then (`None`).
fn wait_until(child: &mut Child, deadline: Instant) -> std::io::Result<Option<ExitStatus>> {
    let mut pause = Duration::from_micros(200);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            let _ = child.kill();
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}
