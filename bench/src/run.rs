//! One measured run: the run's database, topic and streamer config, `outbox-streamer setup`,
//! the streamer under test as a child process, the writers, the checking consumer, and the
//! figures of the [`Report`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_kafka::reader::TopicReader;
use outbox_postgres::connect::PgTarget;

use crate::db::BenchDb;
use crate::private_dir::PrivateDir;
use crate::report::{Report, print_markdown};
use crate::tkms;
use crate::{
    BenchArgs, BenchDelivery, BenchMode, BenchSink, BenchStorage, DbKind, check, load, neighbours, procstat, rabbit,
};

/// Where the streamer under test serves its metrics by default (`--metrics-port`); the report
/// quotes its own latency view.
pub(crate) const BENCH_METRICS_PORT: u16 = 29188;
/// The environment variable the streamer under test reads its password from.
const PASSWORD_VAR: &str = "OUTBOX_BENCH_STREAMER_PASSWORD";
/// The environment variable the streamer under test reads its RabbitMQ URL (and so the
/// broker's password) from, with `--sink rabbitmq`.
const RABBITMQ_URL_VAR: &str = "OUTBOX_BENCH_RABBITMQ_URL";
/// The streamer's config and log in the run's private directory.
const CONFIG_FILE: &str = "outbox-streamer.toml";
const STREAMER_LOG: &str = "streamer.log";
/// The streamer's metrics the report quotes, by their names in docs/metrics.md: the bench
/// reads them from `/metrics` as any scraper does (a unit test below checks the names).
const POLL_QUERY_SECONDS: &str = "outbox_poll_query_seconds";
const END_TO_END_LATENCY: &str = "outbox_end_to_end_latency_seconds";

/// One run of `args` with the streamer binary `streamer`; prints its Markdown row and writes
/// its JSON (`--json`).
pub(crate) async fn bench(mut args: BenchArgs, streamer: &Path) -> anyhow::Result<Report> {
    if args.quick {
        args.duration_s = 3;
        args.rate = 500;
    }
    if args.writers == 0 || args.rows_per_txn == 0 || args.partitions == 0 {
        bail!("--writers, --rows-per-txn and --partitions must be at least 1");
    }
    if args.storage == BenchStorage::Wal && args.mode == BenchMode::Polling {
        bail!("--storage wal needs --mode cdc or ceiling (a WAL-only message is in no table to poll)");
    }
    if args.tw_tkms.is_some()
        && (args.storage == BenchStorage::Wal
            || args.delivery == BenchDelivery::ExactlyOnce
            || args.shared_keys
            || args.hold_open.is_some()
            || args.partitions > 1)
    {
        bail!(
            "--tw-tkms measures tw-tkms's layout alone: without --storage wal, --delivery exactly-once, --shared-keys, --hold-open or --partitions above 1"
        );
    }
    if args.storage == BenchStorage::Wal && args.db == DbKind::Mariadb && args.shared_keys {
        bail!(
            "--shared-keys needs each row's id inside its transaction; with --db mariadb --storage wal the id is known only after COMMIT (its GTID)"
        );
    }
    if args.api
        && (args.mode == BenchMode::Ceiling
            || args.tw_tkms.is_some()
            || args.shared_keys
            || args.backlog.is_some()
            || args.rows_per_txn > 1
            || (args.db == DbKind::Mariadb && args.storage == BenchStorage::Wal))
    {
        bail!(
            "--api needs a streamer (--mode cdc or polling) and our layout, one message per round trip (--rows-per-txn 1), no backlog or --shared-keys, and on MariaDB table storage (a commit must answer the record's outbox-id)"
        );
    }
    let env = |name: &str| {
        std::env::var(name).with_context(|| format!("{name} is not set; run `eval \"$(scripts/services env)\"` first"))
    };
    let admin_url = match args.db {
        DbKind::Postgres => env("OUTBOX_PG_URL")?,
        DbKind::Mariadb => env("OUTBOX_MYSQL_URL")?,
    };
    let brokers = env("OUTBOX_KAFKA_BROKERS")?;
    let services_dir = PathBuf::from(env("OUTBOX_SERVICES_DIR")?);
    let rabbitmq_url = match args.sink {
        BenchSink::Kafka => {
            if args.rabbitmq_url.is_some() || args.confirm_window.is_some() {
                bail!("--rabbitmq-url and --confirm-window need --sink rabbitmq");
            }
            None
        }
        BenchSink::Rabbitmq => {
            if args.delivery == BenchDelivery::ExactlyOnce {
                bail!(
                    "--sink rabbitmq delivers at least once: the streamer refuses delivery = \"exactly-once\" for it"
                );
            }
            Some(match &args.rabbitmq_url {
                Some(url) => url.clone(),
                None => env("OUTBOX_RABBITMQ_URL")?,
            })
        }
    };

    let run_id = format!("bench{}", std::process::id());
    let mut dir = PrivateDir::create("outbox-bench").context("creating a private temporary directory")?;
    let db = BenchDb::create(args.db, &admin_url, &run_id).await?;
    let topic = format!("{run_id}-{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs());
    let result = match &rabbitmq_url {
        None => match outbox_kafka::admin::create_topic(&brokers, &topic, 3, 1).await {
            Ok(()) => {
                let result = run(&args, streamer, &brokers, None, &services_dir, &dir, &db, &run_id, &topic).await;
                if let Err(e) = outbox_kafka::admin::delete_topic(&brokers, &topic).await {
                    eprintln!("warning: cannot delete the bench topic {topic}: {e}; delete it by hand");
                }
                result
            }
            Err(e) => Err(anyhow::Error::new(e).context("creating the bench topic")),
        },
        // The exchange (and its queue) is named like the topic: the rows' `topic` names it.
        Some(url) => match rabbit::RunQueue::declare(url, &topic).await {
            Ok(queue) => {
                let result = run(&args, streamer, &brokers, Some(url), &services_dir, &dir, &db, &run_id, &topic).await;
                if let Err(e) = queue.delete().await {
                    eprintln!(
                        "warning: cannot delete the bench exchange and queue {topic}: {e:#}; delete them by hand"
                    );
                }
                result
            }
            Err(e) => Err(e.context("declaring the bench exchange and queue")),
        },
    };
    db.drop().await;
    if (result.is_err() || args.keep_log) && dir.path().join(STREAMER_LOG).exists() {
        let kept = dir.keep_without(&[CONFIG_FILE]);
        eprintln!("the streamer's log is kept in {}", kept.join(STREAMER_LOG).display());
    }
    let report = result?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print_markdown(&report);
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
async fn run(
    args: &BenchArgs,
    streamer_bin: &Path,
    brokers: &str,
    rabbitmq_url: Option<&str>,
    services_dir: &Path,
    dir: &PrivateDir,
    db: &BenchDb,
    run_id: &str,
    topic: &str,
) -> anyhow::Result<Report> {
    let topic = topic.to_string();
    // The password stays out of the file: `${VAR}` is expanded from the streamer's environment.
    let config_text = format!(
        "[kafka]\nbrokers = \"{brokers}\"\ntransactional_id_prefix = \"{run_id}\"\n\n[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n\n[[source]]\nname = \"bench\"\nkind = \"{kind}\"\n\
             url = \"{url}\"\ntable_prefix = \"{run_id}\"\nshards = 1\npartitions = {p}\n{layout}\n\
             [source.defaults]\nlinger_ms = {linger}\nmode = \"{mode}\"\nstorage = \"{storage}\"\n{cleanup}{status}{poll}{delivery}{sink}",
        kind = db.kind_str(),
        layout = if args.tw_tkms.is_some() { "layout = \"tw-tkms\"\n" } else { "" },
        url = db.streamer_url_with(&format!("${{{PASSWORD_VAR}}}")),
        p = args.partitions,
        linger = args.linger_ms,
        metrics_port = args.metrics_port,
        mode = if args.mode == BenchMode::Polling { "polling" } else { "cdc" },
        storage = if args.storage == BenchStorage::Wal { "wal" } else { "table" },
        cleanup = args.cleanup_interval_ms.map_or_else(String::new, |ms| format!("cleanup_interval_ms = {ms}\n")),
        status = args.status_interval_ms.map_or_else(String::new, |ms| format!("status_interval_ms = {ms}\n")),
        poll = args.poll_interval_ms.map_or_else(String::new, |ms| format!("poll_interval_ms = {ms}\n")),
        delivery = match args.delivery {
            BenchDelivery::AtLeastOnce => String::new(),
            BenchDelivery::ExactlyOnce => format!(
                "delivery = \"exactly-once\"\n{}",
                args.transaction_interval_ms.map_or_else(String::new, |ms| format!("transaction_interval_ms = {ms}\n"))
            ),
        },
        // The URL, password included, comes from the streamer's environment, never the file.
        sink = match args.sink {
            BenchSink::Kafka => String::new(),
            BenchSink::Rabbitmq => format!(
                "sink = \"rabbitmq\"\n\n[rabbitmq]\nurl = \"${{{RABBITMQ_URL_VAR}}}\"\n{}",
                args.confirm_window.map_or_else(String::new, |n| format!("confirm_window = {n}\n"))
            ),
        },
    );
    let api = match args.api {
        true => Some((crate::api::free_addr()?, crate::api::secret())),
        false => None,
    };
    let config_text = match &api {
        Some((listen, _)) => config_text + &crate::api::config(*listen, args.writers),
        None => config_text,
    };
    let config_path = dir.write(CONFIG_FILE, &config_text).context("writing the streamer's config")?;
    let tables: Vec<String> = (0..args.partitions).map(|p| format!("{run_id}_0_{p}")).collect();
    if args.tw_tkms.is_some() {
        tkms::create_tables(db, &tables).await?;
    }
    setup(streamer_bin, &config_path, db, rabbitmq_url).await?;
    db.separate_id_ranges(&tables).await?;
    if args.shared_keys {
        db.create_ledger(16).await?;
    }
    let progress = Arc::new(AtomicUsize::new(0));
    // A backlog goes in before the streamer starts.
    // A backlog's WAL is written while it is inserted; a timed run's while the writers run.
    let backlog_wal_before = db.log_bytes().await?;
    let backlog = match args.backlog {
        Some(rows) => {
            eprintln!("inserting a backlog of {rows} rows with the streamer stopped…");
            let wal = args.storage == BenchStorage::Wal;
            let payload = crate::payload::payload(args.payload_bytes, args.payload_shape);
            let inserted = match args.tw_tkms {
                Some(c) => tkms::insert_backlog(db, c, (&tables[0], &topic), rows, &payload, &progress).await?,
                None => db.insert_backlog(&tables[0], &topic, rows, &payload, wal, &progress).await?,
            };
            if args.catch_up {
                db.mark_catch_up_pending(&format!("{run_id}_checkpoint"), &tables[0]).await?;
            }
            Some(inserted)
        }
        None => None,
    };
    let streamer_started = Instant::now();

    let mut streamer = None;
    let mut checker = None;
    let stop_checker = Arc::new(AtomicBool::new(false));
    let consumed = Arc::new(AtomicUsize::new(0));
    if args.mode != BenchMode::Ceiling {
        let log = dir.file(STREAMER_LOG)?;
        let mut command = Command::new(streamer_bin);
        command.arg("--config").arg(&config_path).arg("run").env(PASSWORD_VAR, &db.streamer_password);
        if let Some(url) = rabbitmq_url {
            command.env(RABBITMQ_URL_VAR, url);
        }
        if let Some((_, secret)) = &api {
            command.env(crate::api::SECRET_VAR, secret);
        }
        let child = command.stdout(Stdio::null()).stderr(log).spawn().context("starting the streamer")?;
        streamer = Some(Streamer(Some(child)));
        if db.kind == DbKind::Postgres && args.mode == BenchMode::Cdc {
            wait_streaming(&db.admin_url, run_id, args.partitions).await?;
        }
        checker = Some(match rabbitmq_url {
            None => {
                let reader = TopicReader::new(brokers, &topic, 3, &format!("{run_id}-checker"))?;
                check::spawn_checker(reader, stop_checker.clone(), consumed.clone())
            }
            Some(url) => {
                let reader = rabbit::QueueReader::new(url, &topic).await?;
                check::spawn_checker(reader, stop_checker.clone(), consumed.clone())
            }
        });
    }

    // Warm-up: rows through the whole path before measuring, so neither the streamer's nor the
    // checker's connection set-up counts as latency. They are not part of the results.
    let warmup = match backlog {
        Some(_) => 0,
        None => warm_up(db, args.tw_tkms, &format!("{run_id}_0_0"), &topic, &consumed, args.mode).await?,
    };

    let held = match args.hold_open {
        Some(kind) => Some(db.hold_open(kind, &format!("{run_id}_0_0"), &topic).await?),
        None => None,
    };
    let db_cpu_before = db.server_cpu(services_dir);
    let mut neighbours = neighbours::Neighbours::start(db).await;
    let wal_before = if backlog.is_some() { backlog_wal_before } else { db.log_bytes().await? };
    let db = Arc::new(db.clone());
    let txn_rate = (args.rate > 0).then(|| args.rate as f64 / args.rows_per_txn as f64 / args.writers as f64);
    if let Some((listen, secret)) = &api {
        crate::api::wait_serving(*listen, secret).await?;
    }
    let round_trips = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut writers = Vec::new();
    for writer in 0..if backlog.is_some() { 0 } else { args.writers } {
        let plan = load::WriterPlan {
            writer,
            table: format!("{run_id}_0_{}", writer as u32 % args.partitions),
            topic: topic.clone(),
            rows_per_txn: args.rows_per_txn,
            payload: crate::payload::payload(args.payload_bytes, args.payload_shape).into(),
            txn_rate,
            duration: Duration::from_secs(args.duration_s),
            keys: 16,
            shared_keys: args.shared_keys,
            wal: args.storage == BenchStorage::Wal,
        };
        let (db, progress, tw_tkms) = (db.clone(), progress.clone(), args.tw_tkms);
        let (api, round_trips) = (api.clone(), round_trips.clone());
        writers.push(tokio::spawn(async move {
            match (api, tw_tkms) {
                (Some((listen, secret)), _) => {
                    crate::api::run_caller(listen, secret, plan, progress, round_trips).await
                }
                (None, Some(c)) => tkms::run_writer(&db, c, plan, progress).await,
                (None, None) => db.run_writer(plan, progress).await,
            }
        }));
    }
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // A progress line on a terminal; nothing in logs.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    while writers.iter().any(|w| !w.is_finished()) {
        tick.tick().await;
        neighbours.sample(&db).await;
        if !tty {
            continue;
        }
        let done = started.elapsed().as_secs_f64() / args.duration_s.max(1) as f64;
        eprint!(
            "\r{} {:>4}s  committed {:>9}  consumed {:>9}",
            bar(done),
            started.elapsed().as_secs(),
            progress.load(Ordering::Relaxed),
            consumed.load(Ordering::Relaxed).saturating_sub(warmup)
        );
    }
    let backlog_run = backlog.is_some();
    let mut committed = backlog.unwrap_or_default();
    for w in writers {
        committed.extend(w.await??);
    }
    let write_secs = started.elapsed().as_secs_f64();
    let wal_after = db.log_bytes().await?;
    let poll_stats = scrape(args.metrics_port, POLL_QUERY_SECONDS).await;

    let mut report = Report {
        scenario: args.scenario.clone(),
        mode: args.mode,
        sink: args.sink,
        storage: args.storage,
        delivery: args.delivery,
        tw_tkms: args.tw_tkms,
        db: args.db,
        target_rate: args.rate,
        writers: args.writers,
        rows_per_txn: args.rows_per_txn,
        payload_bytes: args.payload_bytes,
        payload_shape: args.payload_shape,
        partitions: args.partitions,
        hold_open: args.hold_open,
        shared_keys: args.shared_keys,
        messages: committed.len(),
        duration_s: write_secs,
        throughput_msgs_per_s: committed.len() as f64 / write_secs,
        latency_p50_ms: 0.0,
        latency_p95_ms: 0.0,
        latency_p99_ms: 0.0,
        latency_max_ms: 0.0,
        streamer_cpu_s: None,
        streamer_peak_rss_mb: None,
        db_cpu_s_per_1k: None,
        db_cpu_shared_with: Vec::new(),
        wal_bytes_per_msg: (wal_after - wal_before) as f64 / committed.len().max(1) as f64,
        lost: 0,
        duplicated: 0,
        out_of_order: 0,
        throughput_per_second: Vec::new(),
        streamer_latency_buckets: Vec::new(),
        poll_query_mean_ms: None,
        poll_queries: None,
        backlog: args.backlog,
        drain_s: None,
        latency_quantiles_ms: Vec::new(),
        api_round_trip_ms: api.as_ref().map(|_| {
            let p = check::percentiles(std::mem::take(&mut *round_trips.lock().unwrap_or_else(|e| e.into_inner())));
            (p.p50, p.p99)
        }),
    };
    let stat = |suffix: &str| {
        poll_stats
            .iter()
            .find(|(name, _)| name.split('{').next().is_some_and(|base| base.ends_with(suffix)))
            .and_then(|(_, v)| v.parse::<f64>().ok())
    };
    if let (Some(sum), Some(count)) = (stat("_sum"), stat("_count")) {
        report.poll_query_mean_ms = Some(sum / count.max(1.0) * 1000.0);
        report.poll_queries = Some(count as u64);
    }

    if let Some(checker) = checker {
        // Wait (bounded) for every committed row to arrive.
        let deadline = Instant::now() + Duration::from_secs(if backlog_run { 900 } else { 120 });
        while consumed.load(Ordering::Relaxed) < committed.len() + warmup && Instant::now() < deadline {
            tick.tick().await;
            neighbours.sample(&db).await;
            if !tty {
                continue;
            }
            let got = consumed.load(Ordering::Relaxed).saturating_sub(warmup);
            eprint!(
                "\r{}    draining: consumed {:>9} of {}",
                bar(got as f64 / committed.len().max(1) as f64),
                got,
                committed.len()
            );
        }
        stop_checker.store(true, Ordering::Relaxed);
        let seen = checker.join().map_err(|_| anyhow::anyhow!("checker thread panicked"))??;
        let mut latencies = Vec::with_capacity(committed.len());
        let mut last_arrival = started;
        for (id, at) in &committed {
            match seen.first_arrival.get(id) {
                Some(arrived) => {
                    latencies.push(arrived.saturating_duration_since(*at).as_secs_f64() * 1000.0);
                    last_arrival = last_arrival.max(*arrived);
                }
                None => report.lost += 1,
            }
        }
        if !backlog_run {
            report.latency_quantiles_ms = check::quantiles(&latencies, 100);
        }
        let p = check::percentiles(latencies);
        report.latency_p50_ms = p.p50;
        report.latency_p95_ms = p.p95;
        report.latency_p99_ms = p.p99;
        report.latency_max_ms = p.max;
        report.duplicated = seen.copies.values().map(|c| (*c - 1) as usize).sum();
        report.throughput_per_second = seen.per_second.clone();
        report.out_of_order = if args.shared_keys {
            check::out_of_commit_order(&seen.arrivals, &db.ledger().await?)
        } else {
            seen.out_of_order
        };
        if backlog_run {
            // A drain: rows over the time from the streamer's start to the last record; latency
            // from an insert made before the streamer started says nothing, so none is reported.
            let drain = last_arrival.duration_since(streamer_started).as_secs_f64();
            report.drain_s = Some(drain);
            report.throughput_msgs_per_s = committed.len() as f64 / drain;
            (report.latency_p50_ms, report.latency_p95_ms, report.latency_p99_ms, report.latency_max_ms) =
                (0.0, 0.0, 0.0, 0.0);
        } else {
            // Sustained rate: everything committed, over the time until the last record arrived.
            report.throughput_msgs_per_s = committed.len() as f64 / last_arrival.duration_since(started).as_secs_f64();
        }
    }
    if let (Some(before), Some(after)) = (db_cpu_before, db.server_cpu(services_dir)) {
        report.db_cpu_s_per_1k = Some((after - before) / (committed.len().max(1) as f64 / 1000.0));
    }
    report.db_cpu_shared_with = neighbours.finish(&db).await;
    if streamer.is_some() {
        report.streamer_latency_buckets = scrape(args.metrics_port, END_TO_END_LATENCY)
            .await
            .into_iter()
            .filter(|(name, _)| name.contains("_bucket{"))
            .filter_map(|(name, value)| {
                let le = name.split("le=\"").nth(1)?.split('"').next()?.to_string();
                Some((le, value.parse().ok()?))
            })
            .collect();
    }
    if let Some(held) = held {
        held.finish().await?;
    }
    if let Some(s) = &streamer {
        report.streamer_cpu_s = procstat::cpu_seconds(s.pid());
        report.streamer_peak_rss_mb = procstat::peak_rss_bytes(s.pid()).map(|b| b as f64 / (1 << 20) as f64);
    }
    drop(streamer);
    if tty {
        eprintln!();
    }
    Ok(report)
}

/// `outbox-streamer setup` of the run's config, run as the admin login. The login's URL and the
/// streamer's password go through the environment, as `setup --help` asks, never on the
/// command line; its report goes to this process's stdout and stderr.
async fn setup(streamer_bin: &Path, config: &Path, db: &BenchDb, rabbitmq_url: Option<&str>) -> anyhow::Result<()> {
    let mut command = tokio::process::Command::new(streamer_bin);
    command
        .arg("--config")
        .arg(config)
        .arg("setup")
        .env("OUTBOX_SETUP_URL", &db.admin_url)
        .env(PASSWORD_VAR, &db.streamer_password);
    if let Some(url) = rabbitmq_url {
        command.env(RABBITMQ_URL_VAR, url);
    }
    let status = command
        .stdin(Stdio::null())
        .status()
        .await
        .with_context(|| format!("starting {} setup", streamer_bin.display()))?;
    if !status.success() {
        bail!("outbox-streamer setup failed ({status}); its messages are above");
    }
    Ok(())
}

/// The streamer under test; stopped with SIGTERM (and waited for) when dropped, also when
/// the run fails half-way, so no orphan keeps the metrics port.
struct Streamer(Option<std::process::Child>);

impl Streamer {
    fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, std::process::Child::id)
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let _ = child.wait();
        }
    }
}

/// Commits `WARMUP_ROWS` rows and, with a streamer, waits until they were consumed.
/// Returns how many records the checker will have counted for them.
async fn warm_up(
    db: &BenchDb,
    tw_tkms: Option<tkms::TkmsCompression>,
    table: &str,
    topic: &str,
    consumed: &AtomicUsize,
    mode: BenchMode,
) -> anyhow::Result<usize> {
    const WARMUP_ROWS: usize = 20;
    for i in 0..WARMUP_ROWS {
        let key = format!("warm-up-{i}");
        match tw_tkms {
            Some(c) => tkms::insert_one(db, c, table, topic, &key).await?,
            None => db.insert_one(table, topic, &key).await?,
        }
    }
    if mode == BenchMode::Ceiling {
        return Ok(0);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while consumed.load(Ordering::Relaxed) < WARMUP_ROWS {
        tick.tick().await;
        if Instant::now() > deadline {
            bail!("warm-up rows did not arrive within 60 s; see the streamer's log");
        }
    }
    Ok(WARMUP_ROWS)
}

/// The lines of one metric from the streamer's metrics endpoint, as (name with labels, value).
async fn scrape(port: u16, metric: &str) -> Vec<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return Vec::new();
    };
    let request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    let mut body = String::new();
    if conn.write_all(request.as_bytes()).await.is_err() || conn.read_to_string(&mut body).await.is_err() {
        return Vec::new();
    }
    body.lines()
        .filter(|l| l.starts_with(metric))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.to_string()))
        })
        .collect()
}

/// Waits until every slot of the run is held by the streamer.
async fn wait_streaming(admin_url: &str, prefix: &str, partitions: u32) -> anyhow::Result<()> {
    let admin = PgTarget::from_url(admin_url, None)?.connect().await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let active: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1 AND active",
                &[&format!("{prefix}\\_%")],
            )
            .await?
            .get(0);
        if active >= partitions as i64 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the streamer did not start streaming within 60 s; see the streamer's log");
        }
    }
}

/// A 20-cell progress bar for `done` in 0..=1.
fn bar(done: f64) -> String {
    let cells = (done.clamp(0.0, 1.0) * 20.0).round() as usize;
    format!("[{}{}] {:>3.0}%", "#".repeat(cells), " ".repeat(20 - cells), done.clamp(0.0, 1.0) * 100.0)
}

#[cfg(test)]
mod tests {
    /// The metrics the report quotes are the streamer's documented histograms (the streamer's
    /// own test keeps docs/metrics.md and its metric names in step).
    #[test]
    fn quoted_metrics_are_documented_histograms() {
        let docs = include_str!("../../docs/metrics.md");
        for name in [super::POLL_QUERY_SECONDS, super::END_TO_END_LATENCY] {
            assert!(
                docs.contains(&format!("| `{name}` | histogram |")),
                "{name} is not a histogram in docs/metrics.md"
            );
        }
    }
}
