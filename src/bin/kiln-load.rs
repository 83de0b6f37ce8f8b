//! `kiln-load`: a bounded load test of a running kiln-server. A few
//! prompts' greedy texts are fetched one at a time first; then REQUESTS
//! streamed completions of those prompts run CONCURRENCY at a time. Every
//! request must end complete (its text equal to its prompt's, one response
//! id throughout, `[DONE]` last) or 429; anything else fails the run.
//!
//! ```sh
//! kiln-load --url http://127.0.0.1:8000 --requests 500 --concurrency 64
//! ```

use std::io::{BufRead, BufReader};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use serde_json::{Value, json};

/// A bounded load test of a running kiln-server: streamed greedy
/// completions, each checked complete and equal to its prompt alone, or 429.
#[derive(Parser)]
struct LoadArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model id the server serves.
    #[arg(long, default_value = "embedded")]
    model: String,
    #[arg(long, default_value_t = 500)]
    requests: usize,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sent as `Authorization: Bearer KEY` (also read from KILN_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Count, instead of failing on, complete responses whose text departs
    /// from the same prompt alone after a common start. For f16 on a GPU: a
    /// batched step and a batch-1 step round differently, and a near-tie can
    /// flip a greedy token. The shortest common start is reported.
    #[arg(long)]
    allow_divergence: bool,
}

const PROMPTS: [&str; 8] = [
    "Once upon a time",
    "The capital of France",
    "kiln",
    "1, 2, 3,",
    "Hello",
    "A B C",
    "def main():",
    "Why is the sky blue?",
];

/// How one streamed request went.
enum Outcome {
    Complete {
        ttft: Duration,
        gaps: Vec<Duration>,
        tokens: usize,
        /// Where the text departs from the prompt's text alone, if it does.
        diverged_at: Option<usize>,
    },
    Refused,
}

fn main() -> ExitCode {
    match run(&LoadArgs::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &LoadArgs) -> Result<()> {
    if args.concurrency == 0 || args.requests == 0 {
        bail!("--requests and --concurrency must be at least 1");
    }
    let key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("KILN_API_KEY").ok());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let post = |body: &Value| {
        let mut request = agent.post(format!("{}/v1/completions", args.url));
        if let Some(key) = &key {
            request = request.header("Authorization", format!("Bearer {key}"));
        }
        request
            .header("Content-Type", "application/json")
            .send(body.to_string())
    };
    let body = |prompt: &str, stream: bool| {
        json!({"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
               "temperature": 0, "stream": stream, "stream_options": {"include_usage": true}})
    };
    let mut expected = Vec::new();
    for prompt in PROMPTS {
        let mut response = post(&body(prompt, false)).context("cannot reach the server")?;
        let status = response.status().as_u16();
        let reply: Value = serde_json::from_str(&response.body_mut().read_to_string()?)?;
        if status != 200 {
            bail!("the reference request failed ({status}): {reply}");
        }
        expected.push(
            reply["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        );
    }
    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::new());
    let failures = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..args.concurrency {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= args.requests {
                        return;
                    }
                    let p = i % PROMPTS.len();
                    let sent = Instant::now();
                    let result = post(&body(PROMPTS[p], true))
                        .map_err(anyhow::Error::from)
                        .and_then(|response| {
                            read_stream(response, sent, &expected[p], args.allow_divergence)
                        });
                    match result {
                        Ok(outcome) => outcomes.lock().unwrap().push(outcome),
                        Err(error) => failures
                            .lock()
                            .unwrap()
                            .push(format!("request {i}: {error:#}")),
                    }
                }
            });
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    let outcomes = outcomes.into_inner().unwrap();
    let failures = failures.into_inner().unwrap();
    let mut ttfts = Vec::new();
    let mut gaps = Vec::new();
    let mut tokens = 0;
    let mut refused = 0;
    let mut divergences = Vec::new();
    for outcome in &outcomes {
        match outcome {
            Outcome::Complete {
                ttft,
                gaps: g,
                tokens: t,
                diverged_at,
            } => {
                ttfts.push(ttft.as_secs_f64());
                gaps.extend(g.iter().map(Duration::as_secs_f64));
                tokens += t;
                divergences.extend(*diverged_at);
            }
            Outcome::Refused => refused += 1,
        }
    }
    let complete = ttfts.len();
    println!(
        "{} requests at concurrency {}: {complete} complete, {refused} refused (429), {} failed, in {elapsed:.2}s",
        args.requests,
        args.concurrency,
        failures.len()
    );
    println!(
        "throughput: {:.1} completed requests/s, {:.1} generated tokens/s",
        complete as f64 / elapsed,
        tokens as f64 / elapsed
    );
    println!(
        "time to first token: p50 {:.1} ms, p99 {:.1} ms; inter-token latency: p50 {:.2} ms, p99 {:.2} ms",
        percentile(&mut ttfts, 0.50) * 1e3,
        percentile(&mut ttfts, 0.99) * 1e3,
        percentile(&mut gaps, 0.50) * 1e3,
        percentile(&mut gaps, 0.99) * 1e3
    );
    if let Some(shortest) = divergences.iter().min() {
        println!(
            "{} of {complete} texts depart from the prompt alone, the earliest after {shortest} common characters",
            divergences.len()
        );
    }
    if !failures.is_empty() {
        for failure in failures.iter().take(10) {
            eprintln!("{failure}");
        }
        bail!(
            "{} requests neither completed nor got a 429",
            failures.len()
        );
    }
    Ok(())
}

/// Reads one streamed response and checks it.
fn read_stream(
    mut response: ureq::http::Response<ureq::Body>,
    sent: Instant,
    expected: &str,
    allow_divergence: bool,
) -> Result<Outcome> {
    let status = response.status().as_u16();
    if status == 429 {
        if response.headers().get("retry-after").is_none() {
            bail!("429 without Retry-After");
        }
        return Ok(Outcome::Refused);
    }
    if status != 200 {
        let text = response.body_mut().read_to_string().unwrap_or_default();
        bail!("status {status}: {text}");
    }
    let reader = BufReader::new(response.into_body().into_reader());
    let mut text = String::new();
    let mut id: Option<String> = None;
    let mut first: Option<Instant> = None;
    let mut last = sent;
    let mut gaps = Vec::new();
    let mut tokens = None;
    let mut done = false;
    for line in reader.lines() {
        let line = line.context("the stream broke off")?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if done {
            bail!("data after [DONE]: {data}");
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value =
            serde_json::from_str(data).with_context(|| format!("not JSON: {data}"))?;
        if chunk.get("error").is_some() {
            bail!("an error inside the stream: {chunk}");
        }
        let chunk_id = chunk["id"].as_str().unwrap_or("").to_string();
        if id.get_or_insert_with(|| chunk_id.clone()) != &chunk_id {
            bail!("chunks of two responses in one stream: {id:?} and {chunk_id}");
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            tokens = usage["completion_tokens"].as_u64().map(|t| t as usize);
        }
        if let Some(piece) = chunk["choices"][0]["text"]
            .as_str()
            .filter(|p| !p.is_empty())
        {
            let now = Instant::now();
            match first {
                None => first = Some(now),
                Some(_) => gaps.push(now - last),
            }
            last = now;
            text.push_str(piece);
        }
    }
    if !done {
        bail!("the stream ended without [DONE]");
    }
    let diverged_at = (text != expected).then(|| common_start(&text, expected));
    if diverged_at.is_some() && !allow_divergence {
        return Err(anyhow!(
            "text {text:?} differs from the same prompt alone: {expected:?}"
        ));
    }
    Ok(Outcome::Complete {
        ttft: first.map_or(Duration::ZERO, |f| f - sent),
        gaps,
        tokens: tokens.ok_or_else(|| anyhow!("no usage chunk"))?,
        diverged_at,
    })
}

/// How many characters two texts share from their start.
fn common_start(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
}

fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::common_start;

    #[test]
    fn common_start_counts_shared_leading_characters() {
        assert_eq!(common_start("t1 t2 t3", "t1 t2 t4"), 7);
        assert_eq!(common_start("é t", "é u"), 2);
        assert_eq!(common_start("abc", "abc"), 3);
        assert_eq!(common_start("x", "y"), 0);
    }
}
