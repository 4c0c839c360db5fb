//! `cultnet-gateway run`: the daemon. Every Persona gets her client, ear, mouth and (when her
//! session is live) her turn loop; a Persona that cannot start is reported and the others
//! keep running. The CultNet service answers local clients on the loopback endpoint. SIGINT or
//! SIGTERM stops the tasks, and the inbox is already durable.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gateway::client;
use gateway::config::{Config, Persona, SessionMode};
use gateway::ear::{self, Ear, EarStats, Signals};
use gateway::endpoint::{self, EndpointConfig};
use gateway::inbox::Inbox;
use gateway::mouth::Mouth;
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
    rt.block_on(serve(cfg)).map_err(Failure::from)
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating the state directory {}", cfg.state_dir.display()))?;
    let inbox_path = cfg.state_dir.join("inbox");
    let inbox = Inbox::open(&inbox_path)
        .with_context(|| format!("opening the inbox {}", inbox_path.display()))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut started = 0;
    let mut ports = BTreeMap::new();
    let (endpoint, events, _) =
        endpoint::spawn(EndpointConfig::new(cfg.cultnet.bind, client::rand_seed()))
            .await
            .context("starting the CultNet endpoint")?;
    let cultnet = endpoint.local_addr();
    // The metrics listener comes up first: /readyz says who has not synced yet.
    let shared: gateway::metrics::Ports = Arc::default();
    if let Some(m) = &cfg.metrics {
        let ids = cfg.personas.iter().map(|p| p.id.clone()).collect();
        let addr = gateway::metrics::serve(
            m.bind,
            inbox.clone(),
            ids,
            shared.clone(),
            endpoint.clone(),
            stop_rx.clone(),
        )
        .await
        .with_context(|| format!("starting the metrics listener on {}", m.bind))?;
        tracing::info!(%addr, "metrics on /metrics, /healthz, /readyz");
    }
    for p in &cfg.personas {
        let span = tracing::info_span!("persona", id = %p.id);
        let _enter = span.enter();
        let port = match start_persona(&cfg, p, &inbox, &stop_rx, &mut tasks).await {
            Ok(port) => {
                started += 1;
                tracing::info!(session = ?p.session.mode, "persona started");
                port
            }
            Err(e) => {
                tracing::error!(
                    "persona {} not started: {e:#}; the others keep running",
                    p.id
                );
                Port {
                    failed: Some(format!("{e:#}")),
                    ..Port::new(&p.user_id, p.limits.max_pending)
                }
            }
        };
        shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p.id.clone(), port.clone());
        ports.insert(p.id.clone(), port);
    }
    if started == 0 && !cfg.personas.is_empty() {
        anyhow::bail!("no Persona could start (see the errors above)");
    }
    let runtime_id = format!("cultnet-gateway-{}", uuid::Uuid::new_v4());
    let service = Service::new(
        &runtime_id,
        wire::session::GATEWAY_CONNECTION_ID,
        cfg.cultnet.max_skew_secs,
        inbox.clone(),
        &cfg.cultnet.clients,
        ports,
    );
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
            tasks.spawn(gateway::quic::accept(quic, tx, stop_rx.clone()));
            Some(rx)
        }
        None => None,
    };
    tasks.spawn(service::serve_with(
        service,
        endpoint,
        events,
        remote,
        stop_rx.clone(),
    ));
    tracing::info!(personas = started, %cultnet, clients = cfg.cultnet.clients.len(), "gateway running");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("stopping");
    let _ = stop_tx.send(true);
    // A turn in flight may take its grace, then each CLI its 5 s to exit.
    let grace = cfg
        .personas
        .iter()
        .map(|p| p.session.shutdown_grace_secs)
        .max()
        .unwrap_or(0);
    let _ = tokio::time::timeout(Duration::from_secs(grace + 7), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}

async fn start_persona(
    cfg: &Config,
    p: &Persona,
    inbox: &Inbox,
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
    let mouth = Mouth::new(&p.id, client, inbox.clone(), rooms);
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
        )?;
        port.turn_requests = Some(turns.turn_requests.clone());
        port.controls = Some(turns.controls.clone());
        tasks.spawn(turns.run(stop.clone()));
    }
    Ok(port)
}
