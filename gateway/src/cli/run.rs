//! `cultnet-gateway run`: the daemon. Every Persona gets her client, ear, mouth and (when her
//! session is live) her turn loop; a Persona that cannot start is reported and the others
//! keep running. The CultNet service answers local clients on the loopback endpoint. SIGINT or
//! SIGTERM stops the tasks (a turn in flight gets its grace), and the inbox is already durable.
//! SIGHUP reloads the config: Personas added, removed or changed start, stop or restart, the
//! clients' grants change at once, and an invalid config is refused with the old one kept.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gateway::client;
use gateway::config::{Config, Persona, SessionMode};
use gateway::ear::{self, Ear, EarStats, Signals};
use gateway::inbox::Inbox;
use gateway::metrics::Metrics;
use gateway::mouth::Mouth;
use gateway::processes::Processes;
use gateway::service::{self, Port, Service};
use gateway::turns::TurnLoop;
use session::cost::Ttl;
use session::driver::CliConfig;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::Failure;

pub(super) fn run(config: &Path) -> Result<(), Failure> {
    let cfg = Config::load(config).map_err(|e| Failure::input(e.into()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(serve(config, cfg)).map_err(Failure::from)
}

/// A running Persona: her config, her stop switch, her tasks, and what the service knows of her.
struct Running {
    persona: Persona,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    port: Port,
}

/// What every Persona's parts share: the cap on live processes and the event metrics.
struct Parts {
    processes: Arc<Processes>,
    metrics: Arc<Metrics>,
}

impl Running {
    /// Starts `p` (a failure is reported in her port; the others go on).
    async fn launch(cfg: &Config, p: &Persona, inbox: &Inbox, parts: &Parts) -> Self {
        use tracing::Instrument as _;
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let span = tracing::info_span!("persona", id = %p.id);
        let port = match start_persona(cfg, p, inbox, parts, &stop_rx, &mut tasks)
            .instrument(span.clone())
            .await
        {
            Ok(port) => {
                span.in_scope(|| tracing::info!(session = ?p.session.mode, "persona started"));
                port
            }
            Err(e) => {
                span.in_scope(|| {
                    tracing::error!(
                        "persona {} not started: {e:#}; the others keep running",
                        p.id
                    )
                });
                Port {
                    failed: Some(format!("{e:#}")),
                    ..Port::new(&p.user_id, p.limits.max_pending)
                }
            }
        };
        Self {
            persona: p.clone(),
            stop,
            tasks,
            port,
        }
    }

    /// Stops her: a turn in flight may take its grace, then each CLI its 5 s to exit.
    async fn stop(mut self) {
        let _ = self.stop.send(true);
        let wait = Duration::from_secs(self.persona.session.shutdown_grace_secs + 7);
        let _ = tokio::time::timeout(wait, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
    }
}

/// The service's view of everyone running.
fn ports(running: &BTreeMap<String, Running>) -> BTreeMap<String, Port> {
    running
        .iter()
        .map(|(id, r)| (id.clone(), r.port.clone()))
        .collect()
}

async fn serve(path: &Path, mut cfg: Config) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating the state directory {}", cfg.state_dir.display()))?;
    // Private whatever made it (the process umask makes what is created here 0700 / 0600; one
    // made before, or by hand, is closed to others now).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&cfg.state_dir)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o700);
        if mode & 0o077 != 0 {
            std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o700))
                .with_context(|| format!("making {} private", cfg.state_dir.display()))?;
            tracing::warn!(state_dir = %cfg.state_dir.display(), was = format!("{mode:o}"), "the state directory was open to others; made 0700");
        }
    }
    let inbox_path = cfg.state_dir.join("inbox");
    let inbox = Inbox::open(&inbox_path)
        .with_context(|| format!("opening the inbox {}", inbox_path.display()))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    // The event metrics, handed to each part that counts and to the exporter that serves them.
    let metrics = Arc::new(Metrics::new());
    // The service (its socket and loop on their own thread) starts first, knowing every
    // Persona as starting: clients may read and acknowledge her inbox at once, and learn that
    // she is starting when they ask for more. Her handles follow once she runs.
    let runtime_id = format!("cultnet-gateway-{}", uuid::Uuid::new_v4());
    let starting: BTreeMap<String, Port> = cfg
        .personas
        .iter()
        .map(|p| {
            let port = Port {
                failed: Some("starting".into()),
                ..Port::new(&p.user_id, p.limits.max_pending)
            };
            (p.id.clone(), port)
        })
        .collect();
    let service = Service::new(
        &runtime_id,
        wire::session::GATEWAY_CONNECTION_ID,
        cfg.cultnet.max_skew_secs,
        inbox.clone(),
        &cfg.cultnet.clients,
        starting,
    )
    .with_limits(service::ClientLimits::from(&cfg.cultnet))
    .with_metrics(metrics.clone());
    // The gateway's own key: its Accepts prove it to clients that pinned it.
    let server_key = service::server_key(&cfg.state_dir).with_context(|| {
        format!(
            "the CultNet server key in {}",
            cfg.state_dir.join("cultnet").display()
        )
    })?;
    tracing::info!(
        server_key = %gateway::config::hex(server_key.verifying_key().as_bytes()),
        "CultNet server key (clients may pin it: --server-key)"
    );
    let service = service.with_server_key(server_key);
    let remote = match &cfg.cultnet.quic {
        Some(q) => {
            let identity = gateway::quic::identity(
                q.cert_file.as_deref(),
                q.key_file.as_deref(),
                &cfg.state_dir,
            )
            .context("the QUIC certificate")?;
            let fingerprint = identity.fingerprint();
            let quic = gateway::quic::server(q.bind, identity).context("starting QUIC")?;
            let addr = quic.local_addr().context("the QUIC address")?;
            tracing::info!(%addr, sha256 = %fingerprint, "CultNet over QUIC for remote peers");
            let (tx, rx) = tokio::sync::mpsc::channel(1024);
            tasks.spawn(gateway::quic::accept(
                quic,
                tx,
                metrics.clone(),
                stop_rx.clone(),
            ));
            Some(rx)
        }
        None => None,
    };
    let (updates, updates_rx) = tokio::sync::mpsc::channel(4);
    let started = service::start(
        cfg.cultnet.bind,
        client::rand_seed(),
        service,
        remote,
        Some(updates_rx),
        stop_rx.clone(),
    )
    .await
    .context("starting the CultNet service")?;
    let endpoint = started.endpoint.clone();
    let cultnet = endpoint.local_addr();
    tasks.spawn(async move {
        let _ = started.done.await;
    });
    // The metrics listener comes up before the Personas: /readyz says who has not synced yet.
    let shared: gateway::exporter::Ports = Arc::default();
    if let Some(m) = &cfg.metrics {
        let ids = cfg.personas.iter().map(|p| p.id.clone()).collect();
        let addr = gateway::exporter::serve(
            m.bind,
            inbox.clone(),
            ids,
            shared.clone(),
            endpoint.clone(),
            &metrics,
            stop_rx.clone(),
        )
        .await
        .with_context(|| format!("starting the metrics listener on {}", m.bind))?;
        tracing::info!(%addr, "metrics on /metrics, /healthz, /readyz");
    }
    // Live claude processes across the gateway (`[sessions] max_live`).
    let parts = Parts {
        processes: Processes::new(cfg.sessions.max_live, metrics.clone()),
        metrics,
    };
    let mut running: BTreeMap<String, Running> = BTreeMap::new();
    for p in &cfg.personas {
        let r = Running::launch(&cfg, p, &inbox, &parts).await;
        shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p.id.clone(), r.port.clone());
        running.insert(p.id.clone(), r);
    }
    let started = running.values().filter(|r| r.port.failed.is_none()).count();
    if started == 0 && !cfg.personas.is_empty() {
        anyhow::bail!("no Persona could start (see the errors above)");
    }
    let (retention, retention_rx) = watch::channel(cfg.retention);
    tasks.spawn(prune_hourly(inbox.clone(), retention_rx, stop_rx.clone()));
    let (tx, applied) = tokio::sync::oneshot::channel();
    let update = service::Update {
        clients: cfg.cultnet.clients.clone(),
        ports: ports(&running),
        applied: Some(tx),
    };
    if updates.send(update).await.is_ok() {
        let _ = applied.await;
    }
    tracing::info!(personas = started, %cultnet, clients = cfg.cultnet.clients.len(), "gateway running");
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = hup.recv() => {
                cfg = reload(path, cfg, &inbox, &parts, &mut running, &shared, &updates).await;
                retention.send_if_modified(|r| std::mem::replace(r, cfg.retention) != cfg.retention);
            }
        }
    }
    tracing::info!("stopping");
    let _ = stop_tx.send(true);
    // Every Persona stops at once (each within her grace), and the service with them.
    let mut stopping = JoinSet::new();
    for r in std::mem::take(&mut running).into_values() {
        stopping.spawn(r.stop());
    }
    // The service drains (its answers in flight), then QUIC connections take their last
    // answers and the endpoint closes: a bound on both, with room for the close to go out.
    let service_done =
        tokio::time::timeout(gateway::quic::DRAIN_WAIT + Duration::from_secs(2), async {
            while tasks.join_next().await.is_some() {}
        });
    let personas_done = async { while stopping.join_next().await.is_some() {} };
    let (_, _) = tokio::join!(personas_done, service_done);
    Ok(())
}

/// Prunes the inbox's event-id index and send receipts, then compacts its files if they are
/// mostly dead records ([`upkeep`]): at start, every hour, and at once when SIGHUP changes
/// `[retention]` (off the runtime's workers: it scans sled).
async fn prune_hourly(
    inbox: Inbox,
    mut retention: watch::Receiver<gateway::config::RetentionConfig>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let r = *retention.borrow_and_update();
        let i = inbox.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || upkeep(&i, r)).await {
            tracing::error!("pruning the inbox: {e}");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
            Ok(()) = retention.changed() => {
                tracing::info!("SIGHUP: [retention] changed; pruning with it now");
            }
            _ = stop.changed() => return,
        }
    }
}

/// One prune and compaction check, each logged.
fn upkeep(inbox: &Inbox, r: gateway::config::RetentionConfig) {
    let now = u64::try_from(gateway::clock::unix_ms()).unwrap_or(0);
    match inbox.prune(now, gateway::inbox::Retention::from(&r)) {
        Ok(p) => tracing::info!(
            id_records = p.id_records,
            receipts = p.receipts,
            stamped = p.stamped,
            "inbox pruned"
        ),
        Err(e) => tracing::error!("pruning the inbox: {e}"),
    }
    match inbox.compact_if_wasteful(gateway::inbox::CompactWhen::from(&r)) {
        Ok(Some(c)) => tracing::info!(
            before = c.before,
            after = c.after,
            records = c.records,
            held_ms = c.held.as_millis() as u64,
            "inbox compacted"
        ),
        Ok(None) => {}
        Err(e) => tracing::error!("compacting the inbox: {e}"),
    }
}

/// SIGHUP: reads the config again. An invalid one is refused and logged, and the running one
/// kept. Otherwise removed Personas stop, changed ones restart, added ones start, and the
/// clients' grants are taken at once; the others are not touched. `state_dir`, `cultnet.bind`,
/// `cultnet.quic` and `metrics` take effect only at a restart (said in the log).
async fn reload(
    path: &Path,
    old: Config,
    inbox: &Inbox,
    parts: &Parts,
    running: &mut BTreeMap<String, Running>,
    shared: &gateway::exporter::Ports,
    updates: &tokio::sync::mpsc::Sender<service::Update>,
) -> Config {
    let mut new = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(
                "SIGHUP: the config {} is refused ({e}); the running one is kept",
                path.display()
            );
            return old;
        }
    };
    if new.state_dir != old.state_dir
        || new.cultnet.bind != old.cultnet.bind
        || new.cultnet.quic != old.cultnet.quic
        || new.metrics != old.metrics
        || service::ClientLimits::from(&new.cultnet) != service::ClientLimits::from(&old.cultnet)
        || new.sessions != old.sessions
    {
        tracing::warn!("SIGHUP: state_dir, cultnet.bind, cultnet.quic, the clients' limits, sessions.max_live and metrics take effect at the next restart");
        new.state_dir = old.state_dir.clone();
        new.cultnet.bind = old.cultnet.bind;
        new.cultnet.quic = old.cultnet.quic.clone();
        new.metrics = old.metrics.clone();
        new.sessions = old.sessions;
        new.cultnet.requests_per_sec = old.cultnet.requests_per_sec;
        new.cultnet.request_burst = old.cultnet.request_burst;
        new.cultnet.max_in_flight = old.cultnet.max_in_flight;
    }
    let apply = |running: &BTreeMap<String, Running>, clients: &[gateway::config::Client]| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let u = service::Update {
            clients: clients.to_vec(),
            ports: ports(running),
            applied: Some(tx),
        };
        (u, rx)
    };
    // Removed or changed Personas stop first; the service lets go of them before any starts
    // again on the same Matrix store.
    let going: Vec<String> = running
        .iter()
        .filter(|(id, r)| !new.personas.iter().any(|p| &p.id == *id && *p == r.persona))
        .map(|(id, _)| id.clone())
        .collect();
    for id in &going {
        if let Some(r) = running.remove(id) {
            tracing::info!(persona = %id, "SIGHUP: stopping her (removed or changed)");
            shared.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
            r.stop().await;
        }
    }
    let (u, applied) = apply(running, &old.cultnet.clients);
    if updates.send(u).await.is_ok() {
        let _ = applied.await;
    }
    for p in &new.personas {
        if running.contains_key(&p.id) {
            continue;
        }
        tracing::info!(persona = %p.id, "SIGHUP: starting her (added or changed)");
        let r = Running::launch(&new, p, inbox, parts).await;
        shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p.id.clone(), r.port.clone());
        running.insert(p.id.clone(), r);
    }
    let (u, applied) = apply(running, &new.cultnet.clients);
    if updates.send(u).await.is_ok() {
        let _ = applied.await;
    }
    tracing::info!(
        personas = running.len(),
        clients = new.cultnet.clients.len(),
        "SIGHUP: config reloaded"
    );
    new
}

async fn start_persona(
    cfg: &Config,
    p: &Persona,
    inbox: &Inbox,
    parts: &Parts,
    stop: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<Port> {
    let token = p.load_token()?;
    let stored = inbox.sync_token(&p.id)?;
    let client = gateway::matrix::connect(p, &cfg.state_dir, &token, stored.as_deref()).await?;
    let (rooms, failed) = ear::join_configured(&client, p).await;
    for (room, why) in failed {
        tracing::error!(%room, "room not joined: {why}");
    }
    let signals = Arc::new(Signals::default());
    let ear_stats = Arc::new(EarStats::default());
    let mut ear = Ear::new(
        p.clone(),
        client.clone(),
        inbox.clone(),
        signals.clone(),
        ear_stats.clone(),
    )
    .await;
    if stored.is_none() {
        // Her device uploads its keys in this first sync; its history becomes context.
        ear.round(Duration::ZERO)
            .await
            .context("first sync (recording the position)")?;
    }
    if p.encryption.cross_signing {
        // She still speaks when this fails (clients that read only cross-signed devices will
        // not read her); `check` names the fix too.
        match gateway::identity::secure(&client, p, &cfg.state_dir).await {
            Ok(s) => tracing::info!(
                persona = %p.id,
                cross_signed = s.cross_signed,
                backup = s.backup,
                recovery_key_present = s.recovery_key_present,
                "her identity"
            ),
            Err(e) => tracing::error!(persona = %p.id, "her identity is not secured: {e}"),
        }
    }
    let mouth = Mouth::new(&p.id, client, inbox.clone(), rooms).with_metrics(parts.metrics.clone());
    tasks.spawn(ear.run(stop.clone()));
    let mut port = Port {
        mouth: Some(mouth.clone()),
        signals: signals.clone(),
        ear: Some(ear_stats),
        ..Port::new(&p.user_id, p.limits.max_pending)
    };
    if p.session.mode == SessionMode::Live {
        let s = &p.session;
        let base = CliConfig {
            exe: s.claude.clone(),
            model: s.model.clone(),
            system_prompt_file: s.system_prompt_file.clone().unwrap_or_default(),
            json_schema: session::render::reply_schema(),
            config_dir: cfg.state_dir.join("personas").join(&p.id).join("claude"),
            work_dir: cfg.state_dir.join("personas").join(&p.id).join("work"),
            api_base_url: s.api_base_url.clone(),
            credential: s.load_credential(&p.id)?,
            cache_ttl: if s.cache_ttl == "5m" {
                Ttl::FiveMinutes
            } else {
                Ttl::OneHour
            },
            thinking: s.thinking,
            session_id: None,
            resume: false,
            system_prompt_changed: false,
            max_retries: Some(2),
            turn_timeout: Duration::from_secs(s.turn_timeout_secs),
            grace: Duration::from_secs(10),
        };
        let turns = TurnLoop::new(
            p.clone(),
            inbox.clone(),
            mouth,
            signals,
            base,
            s.reply_schema(&p.id)?,
            &cfg.state_dir,
        )?
        .with_other_personas(
            cfg.personas
                .iter()
                .filter(|o| o.id != p.id)
                .map(|o| o.user_id.clone()),
        )
        .with_processes(parts.processes.clone())
        .with_metrics(parts.metrics.clone());
        port.turn_requests = Some(turns.turn_requests.clone());
        port.controls = Some(turns.controls.clone());
        tasks.spawn(turns.run(stop.clone()));
    }
    Ok(port)
}
