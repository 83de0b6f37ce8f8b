//! `GET /metrics`: Prometheus text from the prometheus-client registry.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub struct Metrics {
    registry: Registry,
    requests: Family<Vec<(String, String)>, Counter>,
    pub queue_depth: Gauge,
    pub active: Gauge,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tokens: Counter,
    /// Prompts prefilled in one call with others (`--batch-slots`).
    pub prefilled_together: Counter,
    speculative_proposed: Counter,
    speculative_accepted: Counter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kiln");
        let requests = Family::<Vec<(String, String)>, Counter>::default();
        let queue_depth = Gauge::default();
        let active = Gauge::default();
        // 1 ms to about 65 s.
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        // 0.1 ms to about 3 s.
        let itl = Histogram::new(exponential_buckets(0.0001, 2.0, 15));
        let tokens = Counter::default();
        registry.register(
            "requests",
            "Completion requests by how they ended",
            requests.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for the engine",
            queue_depth.clone(),
        );
        registry.register(
            "active_sequences",
            "Sequences the engine is generating",
            active.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "From the start of prefill to the first generated token",
            ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Between consecutive generated tokens of one sequence",
            itl.clone(),
        );
        registry.register("generated_tokens", "Tokens generated", tokens.clone());
        let prefilled_together = Counter::default();
        registry.register(
            "prompts_prefilled_together",
            "Prompts prefilled in one call with others waiting at the same step (--batch-slots)",
            prefilled_together.clone(),
        );
        let speculative_proposed = Counter::default();
        let speculative_accepted = Counter::default();
        registry.register(
            "speculative_proposed_tokens",
            "Draft tokens proposed and checked by the model (--speculate)",
            speculative_proposed.clone(),
        );
        registry.register(
            "speculative_accepted_tokens",
            "Draft tokens the model accepted (--speculate)",
            speculative_accepted.clone(),
        );
        Metrics {
            registry,
            requests,
            queue_depth,
            active,
            ttft,
            itl,
            tokens,
            prefilled_together,
            speculative_proposed,
            speculative_accepted,
        }
    }

    /// Counts one speculative pass's proposed and accepted draft tokens.
    pub fn speculated(&self, proposed: usize, accepted: usize) {
        self.speculative_proposed.inc_by(proposed as u64);
        self.speculative_accepted.inc_by(accepted as u64);
    }

    /// Counts one request that ended as `outcome` (complete, cancelled,
    /// invalid, queue_full, timeout, error, shutdown).
    pub fn outcome(&self, outcome: &str) {
        self.requests
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
