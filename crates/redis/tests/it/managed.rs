//! A fleet on managed Redis: TLS (`rediss://`) against a real `redis-server` started with a TLS
//! port and a CA made here, with and without a client certificate; and a Redis Cluster of three
//! real nodes on loopback, where the node the worker is pointed at does not hold the fleet's
//! slot and answers `MOVED`. Each is shown beside the path that breaks: the wrong CA, no client
//! certificate where one is required, plain TCP to a TLS port, and a client that does not follow
//! redirects (the node's own answer).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use stormguard_core::clock::MonotonicClock;
use stormguard_core::limiter::{Limiter, LimiterConfig};
use stormguard_redis::resp::{Connection, RedisError, Value};
use stormguard_redis::server::{RedisProcess, ServerTls};
use stormguard_redis::{Fleet, FleetConfig, FleetMode, RedisTarget};

struct Pki {
    dir: PathBuf,
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (p.self_signed(&key).unwrap(), key)
}

fn pki() -> Pki {
    let dir = std::env::temp_dir().join(format!("stormguard-redis-pki-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca_cert, ca_key) = ca("stormguard test CA");
    let (other, _) = ca("another CA");
    let server_key = KeyPair::generate().unwrap();
    let mut sp = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server = sp.signed_by(&server_key, &ca_cert, &ca_key).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut cp = CertificateParams::new(Vec::<String>::new()).unwrap();
    cp.distinguished_name.push(DnType::CommonName, "stormguard");
    cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = cp.signed_by(&client_key, &ca_cert, &ca_key).unwrap();
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    Pki {
        ca: write("ca.pem", ca_cert.pem()),
        other_ca: write("other.pem", other.pem()),
        server_cert: write("server.pem", server.pem()),
        server_key: write("server.key", server_key.serialize_pem()),
        client_cert: write("client.pem", client.pem()),
        client_key: write("client.key", client_key.serialize_pem()),
        dir,
    }
}

fn url(port: u16, params: &[(&str, &PathBuf)]) -> RedisTarget {
    let q: Vec<String> = params.iter().map(|(k, v)| format!("{k}={}", v.display())).collect();
    format!("rediss://127.0.0.1:{port}/0?{}", q.join("&")).parse().unwrap()
}

async fn ping(target: &RedisTarget) -> Result<Value, RedisError> {
    tokio::time::timeout(Duration::from_secs(5), async {
        Connection::connect(target).await?.command(&[b"PING"]).await
    })
    .await
    .unwrap_or(Err(RedisError::Timeout(Duration::from_secs(5))))
}

/// One renewal of a fleet lease on `target` (an established fleet: its epoch is old, so no
/// quiet period): the mode it leaves the fleet in.
async fn lease(target: RedisTarget) -> FleetMode {
    let mut c = Connection::connect(&target).await.unwrap();
    c.command(&[b"SET", b"stormguard:{dep}:epoch", b"0"]).await.unwrap();
    lease_without_epoch(target).await
}

#[tokio::test]
async fn rediss_with_the_servers_ca_and_a_client_certificate_where_required() {
    let pki = pki();
    for require_client_cert in [false, true] {
        let redis = RedisProcess::start_tls(&ServerTls {
            cert: pki.server_cert.clone(),
            key: pki.server_key.clone(),
            ca: pki.ca.clone(),
            require_client_cert,
        });
        let port = redis.port();
        let with_cert = url(
            port,
            &[
                ("ca_file", &pki.ca),
                ("client_cert", &pki.client_cert),
                ("client_key", &pki.client_key),
            ],
        );
        let without_cert = url(port, &[("ca_file", &pki.ca)]);
        assert_eq!(ping(&with_cert).await.unwrap(), Value::Status("PONG".into()));
        // The fleet's lease over TLS: a lease is granted.
        assert_eq!(lease(with_cert.clone()).await, FleetMode::Fleet, "{with_cert}");
        match require_client_cert {
            false => assert!(ping(&without_cert).await.is_ok()),
            true => assert!(ping(&without_cert).await.is_err(), "no client certificate"),
        }
        // The wrong CA: the server's certificate is refused.
        assert!(ping(&url(port, &[("ca_file", &pki.other_ca)])).await.is_err());
        // Plain TCP to the TLS port: no answer Redis would give.
        assert!(ping(&RedisTarget::plain("127.0.0.1", port)).await.is_err());
    }
}

/// Three `redis-server --cluster-enabled yes` nodes joined with `redis-cli --cluster create`.
/// The worker is pointed at a node that does not hold the fleet's slot: that node answers the
/// lease script with `MOVED`, which the worker follows (and keeps following), and the lease is
/// granted on the node that does — where the fleet's keys then are. Without following, the
/// node's own answer is the `MOVED` error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_without_the_fleets_slot_redirects_and_the_worker_follows() {
    let nodes: Vec<RedisProcess> = (0..3).map(|_| RedisProcess::start_cluster_node()).collect();
    let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli (Debian's redis-tools, installed with redis-server)");
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stdout));
    let target = |n: &RedisProcess| RedisTarget::plain("127.0.0.1", n.port());
    // Until every node says the cluster is up (at most 10 s).
    for n in &nodes {
        let mut ok = false;
        for _ in 0..200 {
            let mut c = Connection::connect(&target(n)).await.unwrap();
            if let Ok(Value::Bulk(info)) = c.command(&[b"CLUSTER", b"INFO"]).await
                && String::from_utf8_lossy(&info).contains("cluster_state:ok")
            {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(ok, "the cluster did not come up");
    }
    // Which node holds the fleet's slot, and one that does not.
    let key = b"stormguard:{dep}:slots";
    let mut owner = None;
    let mut other = None;
    for n in &nodes {
        let mut c = Connection::connect(&target(n)).await.unwrap();
        match c.command(&[b"EXISTS", key]).await {
            Ok(_) => owner = Some(n),
            Err(RedisError::Server(m)) if m.starts_with("MOVED") => other = Some(n),
            Err(e) => panic!("{e}"),
        }
    }
    let (owner, other) = (owner.expect("an owner"), other.expect("a node without the slot"));
    // The node without the slot answers a lease call itself with MOVED.
    let mut c = Connection::connect(&target(other)).await.unwrap();
    let said = c.command(&[b"SET", b"stormguard:{dep}:epoch", b"0"]).await;
    assert!(matches!(&said, Err(RedisError::Server(m)) if m.starts_with("MOVED")), "{said:?}");
    let mut o = Connection::connect(&target(owner)).await.unwrap();
    o.command(&[b"SET", b"stormguard:{dep}:epoch", b"0"]).await.unwrap();
    // The worker, pointed at the wrong node, follows and is granted its lease.
    assert_eq!(lease_without_epoch(target(other)).await, FleetMode::Fleet);
    assert_eq!(
        o.command(&[b"EXISTS", key]).await.unwrap(),
        Value::Int(1),
        "the lease is on the owner"
    );
}

/// [`lease`] without setting the epoch (the caller did, on the right node).
async fn lease_without_epoch(target: RedisTarget) -> FleetMode {
    let config = FleetConfig::new("dep", "i0", target, 20, 2)
        .with_timing(Duration::from_millis(600), Duration::from_millis(100));
    let fleet = Fleet::try_new(config).unwrap();
    let limiter = Limiter::try_new(
        LimiterConfig { cap: 20, ..Default::default() },
        std::sync::Arc::new(MonotonicClock::new()),
    )
    .unwrap();
    let mut worker = fleet.worker(limiter);
    worker.tick().await;
    fleet.mode()
}
