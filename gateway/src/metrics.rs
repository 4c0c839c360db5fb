//! Prometheus metrics (prometheus-client): the families and how they are encoded. What reads
//! the gateway's state at each scrape and serves it is `gateway::exporter`, above it.
//!
//! Two kinds: events counted where they happen (turns, tokens, cost, refresh decisions, sends,
//! Connects) in one [`Metrics`] that the binary makes and hands to each part that records
//! (the turn loops, the mouths, the live-process cap, the CultNet service, the QUIC adapter)
//! and to the exporter, and state read at each scrape (pending
//! mail, sync progress and errors, CultNet peers and datagrams) into a [`Snapshot`] that the
//! registry's collector encodes. Names start with `cultnet_gateway_`; the Grafana dashboard in
//! `deploy/grafana-dashboard.json` uses them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A Persona label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PersonaLabel {
    /// Persona id.
    pub persona: String,
}

/// A Persona and what happened.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Persona id.
    pub persona: String,
    /// `sent`, `correction`, `api_error`, `unauthorized`, ... (turns); `ok`, `failed`,
    /// `rejected` (sends); the decision's name (refresh decisions).
    pub outcome: String,
}

/// A Persona and a kind of token.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// Persona id.
    pub persona: String,
    /// `cache_read`, `cache_write`, `uncached`, `output`.
    pub kind: String,
}

/// Why a Connect was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `malformed`, `bad_signature`, `stale`, `unknown_agent`, `replay`, `address_budget`,
    /// `agent_quota`; QUIC before any Connect: `quic_busy` (every place taken),
    /// `quic_busy_address` (its address holds all it may), `quic_evicted` (closed for a newer one).
    pub reason: String,
}

/// The event metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Turns by outcome.
    pub turns: Family<OutcomeLabels, Counter>,
    /// Turn wall time, CLI included.
    pub turn_seconds: Family<PersonaLabel, Histogram, fn() -> Histogram>,
    /// Prompt and output tokens by kind.
    pub tokens: Family<TokenLabels, Counter>,
    /// Billed cost by the price table.
    pub cost_usd: Family<PersonaLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    /// The refresh policy's decisions.
    pub decisions: Family<OutcomeLabels, Counter>,
    /// Sends by status.
    pub sends: Family<OutcomeLabels, Counter>,
    /// Send latency (request -> receipt).
    pub send_seconds: Family<PersonaLabel, Histogram, fn() -> Histogram>,
    /// Connects accepted.
    pub connects_accepted: Counter,
    /// Connects refused, by reason.
    pub connects_refused: Family<ReasonLabel, Counter>,
    /// Authenticated CultNet peers now.
    pub peers: Gauge,
    /// Requests answered `failed` because their client was over a limit, by limit.
    pub requests_limited: Family<ReasonLabel, Counter>,
    /// CultNet clients disconnected for breaking their limits, by limit.
    pub clients_cut_off: Family<ReasonLabel, Counter>,
    /// 1 while a Persona's spend in the last 24 hours has reached her daily cap (her mail
    /// waits), else 0.
    pub over_budget: Family<PersonaLabel, Gauge>,
    /// When an over-budget Persona resumes, seconds since the epoch (0 when she is not).
    pub budget_resumes_at: Family<PersonaLabel, Gauge>,
    /// Live claude processes stopped to make room for another Persona's (`[sessions] max_live`).
    pub process_evictions: Counter,
    /// Waiting lines retired from a live Persona's mail into her rooms' context
    /// (`[persona.turns] waiting_lines`/`waiting_bytes`, and room for a turn's trigger).
    pub mail_retired: Family<PersonaLabel, Counter>,
}

/// The limits a request can be refused for ([`Metrics::limited`]).
const LIMITED_REASONS: &[&str] = &["rate", "in_flight"];
/// The limits a client can be cut off for ([`Metrics::cut_off`]).
const CUT_OFF_REASONS: &[&str] = &["rate", "unread", "owner"];

fn seconds_histogram() -> Histogram {
    // 5 ms .. ~164 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every family, empty (the limit series at zero).
    pub fn new() -> Self {
        let m = Self {
            turns: Family::default(),
            turn_seconds: Family::new_with_constructor(seconds_histogram),
            tokens: Family::default(),
            cost_usd: Family::default(),
            decisions: Family::default(),
            sends: Family::default(),
            send_seconds: Family::new_with_constructor(seconds_histogram),
            connects_accepted: Counter::default(),
            connects_refused: Family::default(),
            peers: Gauge::default(),
            requests_limited: Family::default(),
            clients_cut_off: Family::default(),
            over_budget: Family::default(),
            budget_resumes_at: Family::default(),
            process_evictions: Counter::default(),
            mail_retired: Family::default(),
        };
        // Every limit's series exists from the start at 0, so a dashboard shows a flat line,
        // not "no data", and a rate over the first cut-off is right.
        for (family, reasons) in m.limit_families() {
            for reason in reasons.iter() {
                let _ = family.get_or_create(&ReasonLabel {
                    reason: (*reason).to_owned(),
                });
            }
        }
        m
    }

    /// The families counted by limit, each with every limit it can be counted for.
    fn limit_families(&self) -> [(&Family<ReasonLabel, Counter>, &'static [&'static str]); 2] {
        [
            (&self.requests_limited, LIMITED_REASONS),
            (&self.clients_cut_off, CUT_OFF_REASONS),
        ]
    }

    /// Counts a finished turn.
    pub fn turn(&self, persona: &str, outcome: &str, seconds: f64) {
        self.turns
            .get_or_create(&OutcomeLabels {
                persona: persona.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
        self.turn_seconds
            .get_or_create(&PersonaLabel {
                persona: persona.to_owned(),
            })
            .observe(seconds);
    }

    /// Books a turn's usage and cost.
    pub fn usage(&self, persona: &str, usage: &session::cost::Usage, cost: f64) {
        for (kind, n) in [
            ("cache_read", usage.cache_read),
            ("cache_write", usage.cache_write_5m + usage.cache_write_1h),
            ("uncached", usage.input),
            ("output", usage.output),
        ] {
            self.tokens
                .get_or_create(&TokenLabels {
                    persona: persona.to_owned(),
                    kind: kind.to_owned(),
                })
                .inc_by(n);
        }
        self.cost_usd
            .get_or_create(&PersonaLabel {
                persona: persona.to_owned(),
            })
            .inc_by(cost);
    }

    /// Counts a refresh decision (`Continue`, `Compact`, `FreshStart`, `KeepWarm`, `Evict`).
    pub fn decision(&self, persona: &str, decision: &str) {
        self.decisions
            .get_or_create(&OutcomeLabels {
                persona: persona.to_owned(),
                outcome: decision.to_owned(),
            })
            .inc();
    }

    /// Counts a send and its latency.
    pub fn send(&self, persona: &str, status: wire::docs::Status, seconds: f64) {
        let status = match status {
            wire::docs::Status::Ok => "ok",
            wire::docs::Status::Rejected => "rejected",
            wire::docs::Status::Failed => "failed",
            wire::docs::Status::Unknown => "unknown",
        };
        self.sends
            .get_or_create(&OutcomeLabels {
                persona: persona.to_owned(),
                outcome: status.to_owned(),
            })
            .inc();
        self.send_seconds
            .get_or_create(&PersonaLabel {
                persona: persona.to_owned(),
            })
            .observe(seconds);
    }

    /// Counts a request refused for its client's `limit` (`rate`, `in_flight`).
    pub fn limited(&self, limit: &str) {
        self.requests_limited
            .get_or_create(&ReasonLabel {
                reason: limit.to_owned(),
            })
            .inc();
    }

    /// Counts a client cut off for its `limit` (`rate`, `unread`).
    pub fn cut_off(&self, limit: &str) {
        self.clients_cut_off
            .get_or_create(&ReasonLabel {
                reason: limit.to_owned(),
            })
            .inc();
    }

    /// Counts a refused Connect.
    pub fn refused(&self, reason: &str) {
        self.connects_refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// Event metrics for a part built without the gateway's (a test, a tool): recorded, never
/// served.
pub fn unserved() -> Arc<Metrics> {
    Arc::new(Metrics::new())
}

/// State read at a scrape.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// Per Persona.
    pub personas: BTreeMap<String, PersonaSnapshot>,
    /// Datagrams received and sent by the CultNet endpoint.
    pub datagrams_in: u64,
    /// Sent.
    pub datagrams_out: u64,
    /// Dropped before any session state, by reason.
    pub dropped: Vec<(&'static str, u64)>,
}

/// One Persona's state at a scrape.
#[derive(Debug, Default, Clone)]
pub struct PersonaSnapshot {
    /// Deliveries pending.
    pub pending: u64,
    /// Seconds since her last successful sync (absent before the first).
    pub sync_lag: Option<f64>,
    /// Sync rounds.
    pub syncs: u64,
    /// Sync rounds that failed, by kind.
    pub sync_errors: u64,
    /// 429 waits.
    pub rate_limited: u64,
    /// Rounds held back at `max_pending`.
    pub held_back: u64,
    /// Deliveries stored.
    pub delivered: u64,
    /// She failed to start (reported, not retried).
    pub failed: bool,
}

impl Snapshot {
    /// Ready: every Persona has synced once, or was reported failed. The ones that are not.
    pub fn not_ready(&self) -> Vec<&str> {
        self.personas
            .iter()
            .filter(|(_, p)| !p.failed && p.syncs == 0)
            .map(|(id, _)| id.as_str())
            .collect()
    }
}

/// Encodes the latest [`Snapshot`] on each scrape.
#[derive(Debug, Default)]
struct StateCollector(Arc<Mutex<Snapshot>>);

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let per = |encoder: &mut DescriptorEncoder,
                   name: &str,
                   help: &str,
                   counter: bool,
                   value: &dyn Fn(&PersonaSnapshot) -> Option<f64>|
         -> Result<(), std::fmt::Error> {
            let kind = if counter {
                prometheus_client::metrics::MetricType::Counter
            } else {
                prometheus_client::metrics::MetricType::Gauge
            };
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for (id, p) in &s.personas {
                let Some(v) = value(p) else { continue };
                let labels = PersonaLabel {
                    persona: id.clone(),
                };
                let m = family.encode_family(&labels)?;
                if counter {
                    ConstCounter::new(v as u64).encode(m)?;
                } else {
                    ConstGauge::new(v).encode(m)?;
                }
            }
            Ok(())
        };
        per(
            &mut encoder,
            "pending",
            "Deliveries waiting to be acknowledged",
            false,
            &|p| Some(p.pending as f64),
        )?;
        per(
            &mut encoder,
            "sync_lag_seconds",
            "Seconds since her last successful sync",
            false,
            &|p| p.sync_lag,
        )?;
        per(&mut encoder, "syncs", "Sync rounds stored", true, &|p| {
            Some(p.syncs as f64)
        })?;
        per(
            &mut encoder,
            "sync_errors",
            "Sync rounds that failed",
            true,
            &|p| Some(p.sync_errors as f64),
        )?;
        per(
            &mut encoder,
            "sync_429_waits",
            "Waits a 429 from the homeserver asked for",
            true,
            &|p| Some(p.rate_limited as f64),
        )?;
        per(
            &mut encoder,
            "sync_held_back",
            "Sync rounds held back at max_pending",
            true,
            &|p| Some(p.held_back as f64),
        )?;
        per(&mut encoder, "delivered", "Deliveries stored", true, &|p| {
            Some(p.delivered as f64)
        })?;
        per(
            &mut encoder,
            "persona_failed",
            "1 when she could not start",
            false,
            &|p| Some(f64::from(u8::from(p.failed))),
        )?;
        let c = ConstCounter::new(s.datagrams_in);
        c.encode(encoder.encode_descriptor(
            "datagrams_in",
            "CultNet datagrams received",
            None,
            c.metric_type(),
        )?)?;
        let c = ConstCounter::new(s.datagrams_out);
        c.encode(encoder.encode_descriptor(
            "datagrams_out",
            "CultNet datagrams sent",
            None,
            c.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "datagrams_dropped",
            "CultNet datagrams dropped before any session state, by reason",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (reason, n) in &s.dropped {
            let labels = ReasonLabel {
                reason: (*reason).to_owned(),
            };
            ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The registry: the [`global`] event metrics and the state collector.
pub(crate) fn registry(state: Arc<Mutex<Snapshot>>, m: &Metrics) -> Registry {
    let mut r = Registry::with_prefix("cultnet_gateway");
    r.register(
        "turns",
        "Turns of her live session, by outcome",
        m.turns.clone(),
    );
    r.register(
        "turn_duration_seconds",
        "Turn wall time, CLI included",
        m.turn_seconds.clone(),
    );
    r.register(
        "tokens",
        "Prompt and output tokens, by kind",
        m.tokens.clone(),
    );
    r.register(
        "cost_usd",
        "Billed cost by the price table",
        m.cost_usd.clone(),
    );
    r.register(
        "refresh_decisions",
        "The refresh policy's decisions",
        m.decisions.clone(),
    );
    r.register("sends", "Matrix sends, by status", m.sends.clone());
    r.register(
        "over_budget",
        "1 while a Persona's spend in the last 24 hours has reached her daily cap",
        m.over_budget.clone(),
    );
    r.register(
        "mail_retired",
        "Waiting lines retired from a live Persona's mail into her rooms' context",
        m.mail_retired.clone(),
    );
    r.register(
        "process_evictions",
        "Live claude processes stopped to make room for another Persona's (sessions.max_live)",
        m.process_evictions.clone(),
    );
    r.register(
        "budget_resumes_at_seconds",
        "When an over-budget Persona resumes (seconds since the epoch; 0 when she is not over)",
        m.budget_resumes_at.clone(),
    );
    r.register(
        "send_duration_seconds",
        "Send request to receipt",
        m.send_seconds.clone(),
    );
    r.register(
        "connects_accepted",
        "CultNet Connects accepted",
        m.connects_accepted.clone(),
    );
    r.register(
        "connects_refused",
        "CultNet Connects refused, by reason",
        m.connects_refused.clone(),
    );
    r.register(
        "cultnet_peers",
        "Authenticated CultNet peers",
        m.peers.clone(),
    );
    r.register(
        "requests_limited",
        "CultNet requests answered failed for their client's limit, by limit",
        m.requests_limited.clone(),
    );
    r.register(
        "clients_cut_off",
        "CultNet clients disconnected for breaking their limits, by limit",
        m.clients_cut_off.clone(),
    );
    r.register_collector(Box::new(StateCollector(state)));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_limit_series_exists_at_zero_from_the_start() {
        let m = Metrics::new();
        for (family, reasons) in m.limit_families() {
            for reason in reasons.iter() {
                let label = ReasonLabel {
                    reason: (*reason).to_owned(),
                };
                let count = family.get(&label).map(|c| c.get());
                assert_eq!(count, Some(0), "{reason}");
            }
        }
    }

    #[test]
    fn the_registry_encodes_events_and_state() {
        let state = Arc::new(Mutex::new(Snapshot {
            personas: [(
                "mira".to_owned(),
                PersonaSnapshot {
                    pending: 3,
                    sync_lag: Some(1.5),
                    syncs: 7,
                    ..PersonaSnapshot::default()
                },
            )]
            .into(),
            datagrams_in: 11,
            datagrams_out: 12,
            dropped: vec![("malformed", 2)],
        }));
        let m = Metrics::new();
        m.refused("replay");
        m.send("mira", wire::docs::Status::Ok, 0.02);
        m.limited("rate");
        m.cut_off("unread");
        let r = registry(state, &m);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        for want in [
            "cultnet_gateway_pending{persona=\"mira\"} 3",
            "cultnet_gateway_sync_lag_seconds{persona=\"mira\"} 1.5",
            "cultnet_gateway_syncs_total{persona=\"mira\"} 7",
            "cultnet_gateway_datagrams_in_total 11",
            "cultnet_gateway_datagrams_dropped_total{reason=\"malformed\"} 2",
            "cultnet_gateway_connects_refused_total{reason=\"replay\"}",
            "cultnet_gateway_sends_total{persona=\"mira\",outcome=\"ok\"}",
            "cultnet_gateway_requests_limited_total{reason=\"rate\"}",
            "cultnet_gateway_clients_cut_off_total{reason=\"unread\"}",
            "# EOF",
        ] {
            assert!(text.contains(want), "{want:?} missing:\n{text}");
        }
        let s = Snapshot {
            personas: [
                (
                    "a".to_owned(),
                    PersonaSnapshot {
                        syncs: 1,
                        ..Default::default()
                    },
                ),
                ("b".to_owned(), PersonaSnapshot::default()),
                (
                    "c".to_owned(),
                    PersonaSnapshot {
                        failed: true,
                        ..Default::default()
                    },
                ),
            ]
            .into(),
            ..Snapshot::default()
        };
        assert_eq!(s.not_ready(), ["b"]);
    }
}
