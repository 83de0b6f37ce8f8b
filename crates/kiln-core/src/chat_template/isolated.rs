//! Rendering a chat template in a child process, so that a template that
//! crashes its renderer cannot take the process that serves with it.
//!
//! The render is bounded in steps, memory and output and runs on a large
//! stack of its own, but minijinja lets a template put a namespace inside
//! its own attribute (`{% set ns.x = [ns] %}`), and printing or comparing
//! such a value recurses until any stack overflows: an abort, not an error.
//! The child is this same executable (`/proc/self/exe`), told by
//! [`CHILD_ENV`] to render one request from its standard input and exit; a
//! program that renders this way calls [`serve_child_if_asked`] first thing
//! in `main`.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{ChatTemplate, MAX_RENDERED_BYTES, Message, UNUSABLE};
use crate::error::{Error, Result};

/// Set in the child's environment: render the request on stdin, then exit.
pub const CHILD_ENV: &str = "KILN_CHAT_TEMPLATE_CHILD";
/// A render that takes longer is killed (its fuel bounds it far below).
const CHILD_TIMEOUT: Duration = Duration::from_secs(30);

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
    Refused(String),
}

/// In the child (when [`CHILD_ENV`] is set): renders the request on
/// standard input, writes the reply to standard output and exits. Elsewhere
/// it returns at once.
pub fn serve_child_if_asked() {
    if std::env::var_os(CHILD_ENV).is_none() {
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
                Err(other) => Reply::Refused(other.to_string()),
            }
        }
    };
    let mut out = std::io::stdout().lock();
    let written = serde_json::to_writer(&mut out, &reply).is_ok() && out.flush().is_ok();
    std::process::exit(if written { 0 } else { 1 });
}

impl ChatTemplate {
    /// [`ChatTemplate::render`] in a child process (see the module): the
    /// same prompt or the same error, and an error, never a crash, when the
    /// template crashes its renderer.
    pub fn render_isolated(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let failed = |message: String| Error::ChatTemplate {
            origin: self.origin.clone(),
            message,
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
        let mut child = Command::new("/proc/self/exe")
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| failed(format!("cannot start its renderer: {e}")))?;
        // Written from a thread of its own: a child that prints while we
        // still write would otherwise block both.
        let mut stdin = child.stdin.take().expect("piped");
        let writer = std::thread::spawn(move || stdin.write_all(&request));
        let mut output = Vec::new();
        let mut stdout = child.stdout.take().expect("piped");
        let read = (&mut stdout)
            .take((MAX_RENDERED_BYTES as u64) * 8)
            .read_to_end(&mut output);
        let status = wait_bounded(&mut child);
        let _ = writer.join();
        let status = status.map_err(|e| failed(format!("its renderer did not finish: {e}")))?;
        if !status.success() {
            return Err(failed(format!(
                "rendering it crashed its renderer ({status}: a value that contains itself, \
                 or another abort){UNUSABLE}"
            )));
        }
        read.map_err(|e| failed(format!("cannot read its renderer's reply: {e}")))?;
        match serde_json::from_slice::<Reply>(&output) {
            Ok(Reply::Rendered(text)) => Ok(text),
            Ok(Reply::Refused(message)) => Err(failed(message)),
            Err(e) => Err(failed(format!("its renderer's reply is unreadable: {e}"))),
        }
    }
}

/// Waits for `child` for [`CHILD_TIMEOUT`] at most, then kills it.
fn wait_bounded(child: &mut std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    let deadline = Instant::now() + CHILD_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
