//! One replica of a highly available control plane ([`crate::ha`]): a follower answering
//! `UNAVAILABLE` naming the leader until it is elected, then the leader serving on the same port.

use super::*;

/// One replica of a highly available control plane: campaigns on
/// `etcd.election` with `advertise` (the URL clients should use) and, once elected, rebuilds
/// the state from the journal kept in etcd under `prefix`, serves on `cfg.listen` and sends its
/// epoch on every engine call. `cfg.journal_path` is not used. A deposed leader's journal
/// writes fail ([`Error::Fenced`]) and the process stops (status 74), so a supervisor restarts
/// it as a follower.
///
/// # Errors
/// As [`spawn`]; [`Error::Config`] when etcd cannot be reached.
pub async fn spawn_ha(
    cfg: ControlPlaneConfig,
    etcd: &crate::ha::EtcdConfig,
    advertise: &str,
    prefix: &str,
) -> Result<(SocketAddr, ServerHandle), Error> {
    cfg.security.check(cfg.listen)?;
    let (listener, bound) = bind(cfg.listen).await?;
    // One accept loop hands connections to the server of the moment: the follower's until this
    // replica is elected, the leader's after (the follower's connections are closed then, and
    // their clients reconnect to the leader's).
    let (to_follower, follower_conns) = mpsc::channel(64);
    let route = Arc::new(Mutex::new(to_follower));
    {
        let route = Arc::clone(&route);
        tokio::spawn(async move {
            loop {
                let conn = listener.accept().await.map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    s
                });
                let to = lock(&route).clone();
                if to.send(conn).await.is_err() {
                    tracing::debug!("connection dropped: its server is gone");
                }
            }
        });
    }
    let (stop_follower, follower_stopped) = oneshot::channel::<()>();
    // The follower speaks TLS when the leader does: a client configured for the fleet reaches
    // either and reads the leader's name from the answer. It authenticates as the leader does
    // (issue 29): a caller without a valid token is answered UNAUTHENTICATED (one outside the
    // method's roles PERMISSION_DENIED) before it learns where the leader is.
    let follower = tokio::spawn(
        transport(&cfg.security, bound)?
            .layer(crate::auth::AuthLayer {
                table: cfg.security.tokens.clone(),
            })
            .add_routes(follower_routes(etcd.clone(), advertise.to_string()))
            .serve_with_incoming_shutdown(ReceiverStream::new(follower_conns), async move {
                let _ = follower_stopped.await;
            }),
    );
    let leadership = Arc::new(crate::ha::Leadership::campaign(etcd, advertise).await?);
    let (to_leader, leader_conns) = mpsc::channel(64);
    *lock(&route) = to_leader;
    let _ = stop_follower.send(());
    let _ = follower.await;
    let epoch = u64::try_from(leadership.epoch().0).unwrap_or(0);
    tracing::info!(%bound, epoch, advertise, "elected control-plane leader");
    {
        // A leader that cannot renew its lease is deposed: another replica may be elected once
        // the lease expires, and this one's journal writes are fenced from then on. It stops at
        // once rather than act on a state another leader now owns; a supervisor restarts it as
        // a follower.
        let deposed = leadership.deposed();
        tokio::spawn(async move {
            if !deposed.await {
                return;
            }
            tracing::error!(
                epoch,
                "lost the control-plane leadership (lease not renewed): exiting"
            );
            eprintln!("mx control: lost the leadership of epoch {epoch}; exiting (status 74)");
            std::process::exit(74);
        });
    }
    let (journal, loaded) = Journal::open_etcd(
        etcd,
        leadership,
        prefix,
        tokio::runtime::Handle::current(),
        cfg.compaction.unchecked(),
    )
    .await?;
    let shared = Arc::new(Shared::from_journal(
        journal,
        loaded,
        cfg.security.engine_token.as_deref(),
        Some(epoch),
        cfg.compaction,
    )?);
    let (svc, shared) = serve_shared(shared);
    log_listening(&cfg, bound);
    let conns = ReceiverStream::new(leader_conns);
    let tokens = cfg.security.tokens.clone();
    let handle = ServerHandle::start(bound, Arc::downgrade(&shared), |shutdown| {
        run_on(svc, shared, cfg.security, conns, bound, shutdown)
    })
    .with_tokens(tokens);
    Ok((bound, handle))
}

/// A follower's answer to every RPC: `UNAVAILABLE`, naming the leader (looked up in etcd at
/// each call) in the message and in [`crate::client::LEADER_HEADER`], so a client can go there.
fn follower_routes(etcd: crate::ha::EtcdConfig, me: String) -> tonic::service::Routes {
    let router = axum::Router::new().fallback(move || {
        let (etcd, me) = (etcd.clone(), me.clone());
        async move {
            let (leader, url) = match crate::ha::leader(&etcd).await {
                Ok(Some((url, epoch))) => (format!("the leader is {url} ({epoch})"), Some(url)),
                Ok(None) => ("no leader is elected yet".to_string(), None),
                Err(e) => (format!("the leader is unknown: {e}"), None),
            };
            let mut status = Status::unavailable(format!(
                "this control-plane replica ({me}) is a follower: {leader}"
            ));
            // The leader's URL for clients to follow (a URL that is not a valid header value is
            // only in the message).
            if let Some(v) = url.and_then(|u| u.parse().ok()) {
                status
                    .metadata_mut()
                    .insert(crate::client::LEADER_HEADER, v);
            }
            let (parts, body) = status.into_http::<tonic::body::Body>().into_parts();
            axum::http::Response::from_parts(parts, axum::body::Body::new(body))
        }
    });
    tonic::service::Routes::from(router)
}
