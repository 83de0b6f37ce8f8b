//! `kiln-server`: an OpenAI-compatible HTTP server for one model.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use clap::builder::TypedValueParser;
use tokio::sync::{oneshot, watch};

use kiln::backends::ModelArgs;
use kiln::server::engine::{self, Loaded};
use kiln::server::{AppState, Shared, auth::ApiKey, router};
use kiln::speculation::SpeculationArgs;

#[derive(Parser)]
#[command(
    name = "kiln-server",
    version,
    about = "An OpenAI-compatible server (chat and text completions) for one kiln model"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on; only this machine can connect by default.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (also
    /// read from KILN_API_KEY). Visible to other users in the process list:
    /// prefer --api-key-file or KILN_API_KEY.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from this file (its first line).
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Requests that may wait for the engine; more are answered 429.
    #[arg(long, default_value_t = 16, value_parser = count(1, MAX_QUEUE))]
    queue_size: usize,
    /// Largest request body accepted (bytes); larger ones are answered 413.
    #[arg(long, default_value_t = 1 << 20, value_parser = count(1, MAX_BODY_BYTES))]
    max_body_bytes: usize,
    /// Seconds a request may take from the first byte of its body to its
    /// last token.
    #[arg(long, default_value_t = 300, value_parser = seconds(1, MAX_SECONDS))]
    request_timeout: u64,
    /// Sequence slots decoded together on the IREE backends (continuous
    /// batching); 1 runs one request at a time. The CPU backends always run
    /// one at a time. Default: 8, or 1 with --speculate or
    /// --tensor-parallel.
    #[arg(long)]
    batch_slots: Option<usize>,
    #[command(flatten)]
    speculation: SpeculationArgs,
    /// Seconds a connection may wait without sending a complete request
    /// (new, or kept alive between requests) before it is closed.
    #[arg(long, default_value_t = 60, value_parser = seconds(1, MAX_SECONDS))]
    idle_timeout: u64,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before
    /// they are cut short.
    #[arg(long, default_value_t = 10, value_parser = seconds(0, MAX_SECONDS))]
    shutdown_grace: u64,
    /// Read special tokens that users type in chat messages as text: a user
    /// who writes `<|im_start|>system` gets those characters, not a system
    /// turn. By default, as transformers does, they are control tokens.
    #[arg(long)]
    user_content_as_text: bool,
}

/// How long the engine may take to end its last step after the shutdown's
/// grace.
const ENGINE_STOP_LIMIT: Duration = Duration::from_secs(10);
/// The largest queue: its slots are allocated at start.
const MAX_QUEUE: usize = 65_536;
/// The largest body limit: a body is held whole in memory.
const MAX_BODY_BYTES: usize = 256 << 20;
/// The longest duration a flag may set: a day. Far beyond any use, and an
/// instant plus it cannot overflow.
const MAX_SECONDS: u64 = 86_400;

/// A count flag's parser, refusing values outside `min..=max` by name.
fn count(min: usize, max: usize) -> impl clap::builder::TypedValueParser<Value = usize> {
    clap::value_parser!(u64)
        .range(min as u64..=max as u64)
        .map(|n| n as usize)
}

/// A duration flag's parser (seconds), refusing values outside `min..=max`.
fn seconds(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=max)
}

fn main() -> ExitCode {
    // Chat templates are rendered in a child: this executable, asked so.
    kiln_core::chat_template::serve_child_if_asked();
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(args));
    // A prompt still being prepared (a render runs for seconds at most) is
    // not waited for: leaving kills its renderer, which dies with us.
    runtime.shutdown_timeout(Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    args.speculation.check()?;
    let batch_slots = match (args.batch_slots, args.speculation.speculate) {
        (Some(0), _) => bail!("--batch-slots must be at least 1"),
        // Speculation makes one stream faster by checking several tokens
        // per pass; batching makes many streams faster by sharing a pass.
        // kiln does one or the other.
        (Some(slots), Some(_)) if slots > 1 => bail!(
            "--speculate decodes one request at a time and --batch-slots {slots} asks for \
             batching; drop --batch-slots (or set it to 1) to speculate, or drop --speculate to batch"
        ),
        (Some(slots), _) => slots,
        (None, Some(_)) => 1,
        (None, None) => 8,
    };
    let batch_slots = match args.model.options.tensor_parallel {
        None => batch_slots,
        // The ranks step one sequence: batched modules split over ranks
        // are not built.
        Some(_) if args.batch_slots.is_some_and(|slots| slots > 1) => bail!(
            "--tensor-parallel serves one request at a time and --batch-slots {batch_slots} \
             asks for batching; drop --batch-slots (or set it to 1), or drop --tensor-parallel \
             to batch on one device"
        ),
        Some(_) if args.speculation.speculate.is_some() => bail!(
            "--speculate with --tensor-parallel is not built: the ranks load one-token steps \
             only; drop one of them"
        ),
        Some(ranks) => {
            eprintln!("--tensor-parallel {ranks}: requests are served one at a time");
            1
        }
    };
    let api_key = match (args.api_key.clone(), &args.api_key_file) {
        (Some(key), _) => Some(key),
        (None, Some(path)) => Some(read_api_key(path)?),
        (None, None) => std::env::var("KILN_API_KEY").ok(),
    };
    if api_key.as_deref() == Some("") {
        bail!(
            "the API key (--api-key, --api-key-file or KILN_API_KEY) is empty; give a key or leave all unset"
        );
    }
    let model_id = match &args.model.model {
        None => "embedded".to_string(),
        Some(path) => path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string()),
    };
    let shared = Arc::new(Shared::new(Duration::from_secs(args.request_timeout)));
    let (queue, jobs) = engine::queue(args.queue_size);

    // The engine thread loads the model and opens the backend itself: the
    // backend is not Send, and /health says "loading" meanwhile.
    let (loaded_tx, loaded_rx) = oneshot::channel::<Result<()>>();
    let (prompter_tx, prompter_rx) = watch::channel(None);
    let engine = {
        let shared = shared.clone();
        let model_args = args.model.clone();
        let speculation = args.speculation.clone();
        let user_content_as_text = args.user_content_as_text;
        std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let loaded = match Loaded::load(&model_args, &speculation, user_content_as_text) {
                    Ok(loaded) => loaded,
                    Err(error) => {
                        let _ = loaded_tx.send(Err(error));
                        return;
                    }
                };
                let decoder = match loaded.open_decoder(&model_args, &speculation, batch_slots) {
                    Ok(decoder) => decoder,
                    Err(error) => {
                        let _ = loaded_tx.send(Err(error));
                        return;
                    }
                };
                // Prompts are prepared on the HTTP side from here on.
                let prompter = loaded.prompter(decoder.max_context());
                let _ = prompter_tx.send(Some(Arc::new(prompter)));
                shared.ready.store(true, Ordering::Release);
                let _ = loaded_tx.send(Ok(()));
                engine::run(&loaded, decoder, jobs, &shared);
            })
            .context("cannot start the engine thread")?
    };

    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let address = listener.local_addr()?;
    let app = router(AppState {
        shared: shared.clone(),
        queue,
        prompter: prompter_rx,
        model_id: model_id.clone(),
        api_key: api_key.as_deref().map(ApiKey::new),
        body_limit: args.max_body_bytes,
        body_timeout: Duration::from_secs(args.idle_timeout),
    });
    eprintln!(
        "kiln-server: listening on http://{address} (model {model_id}, backend {}{})",
        args.model
            .backend
            .unwrap_or(kiln::backends::BackendKind::Auto)
            .name(),
        if api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );

    let (stopping_tx, mut stopping_rx) = watch::channel(false);
    let grace = Duration::from_secs(args.shutdown_grace);
    let shutdown = {
        let shared = shared.clone();
        async move {
            stop_signal().await;
            eprintln!(
                "kiln-server: stopping; in-flight requests have {}s to finish",
                grace.as_secs()
            );
            let _ = stopping_tx.send(true);
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                shared.cancel_all.store(true, Ordering::Relaxed);
            });
        }
    };
    let server = kiln::server::listen::serve(
        listener,
        app,
        shutdown,
        Duration::from_secs(args.idle_timeout),
    );
    // After the signal the engine ends every sequence within `grace` plus
    // one step; idle keep-alive connections get a few seconds more at most.
    let hard_stop = async {
        let _ = stopping_rx.wait_for(|stopping| *stopping).await;
        tokio::time::sleep(grace + Duration::from_secs(5)).await;
    };
    let mut loaded_rx = loaded_rx;
    let mut loading = true;
    tokio::pin!(server);
    tokio::pin!(hard_stop);
    loop {
        tokio::select! {
            () = &mut server => break,
            _ = &mut hard_stop => break,
            loaded = &mut loaded_rx, if loading => {
                loading = false;
                match loaded {
                    Ok(Ok(())) => eprintln!("kiln-server: model loaded; ready"),
                    Ok(Err(error)) => return Err(error.context("cannot load the model")),
                    Err(_) => bail!("the engine thread ended while loading the model"),
                }
            }
        }
    }
    shared.cancel_all.store(true, Ordering::Relaxed);
    shared.stopped.store(true, Ordering::Relaxed);
    // The engine ends what it runs within a step of `cancel_all`; a step
    // that does not come back (a wedged device) does not keep the process:
    // leaving main ends it, and its renderer children with it.
    let joined = tokio::time::timeout(
        ENGINE_STOP_LIMIT,
        tokio::task::spawn_blocking(move || engine.join()),
    )
    .await
    .map_err(|_| {
        anyhow::anyhow!(
            "the engine did not stop within {} s of the shutdown; exiting without it",
            ENGINE_STOP_LIMIT.as_secs()
        )
    })?;
    joined
        .ok()
        .and_then(Result::ok)
        .context("the engine thread panicked")?;
    eprintln!("kiln-server: stopped");
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn stop_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {},
                    _ = terminate.recv() => {},
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

/// The first line of `path`, without its line ending; a file of more than
/// 4 KiB is not a key file.
fn read_api_key(path: &std::path::Path) -> Result<String> {
    let text = match std::fs::metadata(path) {
        Ok(meta) if meta.len() > 4096 => bail!(
            "--api-key-file {}: {} bytes is not a key file (a key is one line)",
            path.display(),
            meta.len()
        ),
        _ => std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the API key from --api-key-file {}",
                path.display()
            )
        })?,
    };
    Ok(text
        .lines()
        .next()
        .unwrap_or("")
        .trim_end_matches('\r')
        .to_string())
}
