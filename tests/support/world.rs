//! A test's world: a fresh database with the least-privilege streamer login, fresh Kafka
//! topics, a config and `setup` already run — built by name and settings:
//!
//! ```ignore
//! let w = World::postgres("name").shards(2).kafka_partitions(3).build().await;
//! let w = World::mysql("name").config(POLLING).exclusive().build().await;
//! ```
//!
//! The world holds the services shared (or, with [`WorldBuilder::exclusive`], alone, for a
//! test that stops one) for as long as it lives.

use std::marker::PhantomData;
use std::path::PathBuf;
use std::time::Duration;

use super::database::Database;
use super::mysql::MyDb;
use super::pg::PgDb;
use super::streamer::{Running, run_cli, scratch, source_config_with};
use super::{kafka, unique, wait_until};

/// How long a test waits for rows to arrive or drain.
pub(crate) const ARRIVAL: Duration = Duration::from_secs(120);

/// A program run before `setup` with the admin URL, the table prefix and the topic.
type BeforeSetup = Box<dyn FnOnce(String, String, String) + Send>;

/// A test's database, topic and config; see the module docs.
pub(crate) struct World<D> {
    _services: ServicesHold,
    pub db: D,
    /// The outbox tables' prefix: shard-partition `s/p` is table `<prefix>_<s>_<p>`.
    pub prefix: String,
    pub topic: String,
    /// Partitions of `topic`.
    pub kafka_partitions: i32,
    /// Scratch directory: the config and the streamers' logs.
    pub dir: PathBuf,
    pub config: PathBuf,
    /// The least-privilege streamer login's URL, as the config names it.
    pub streamer_url: String,
}

/// The shared or exclusive hold on the services (released on drop).
enum ServicesHold {
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'static, ()>),
}

/// Settings of a [`World`] before it is built; every one defaults to the simplest world
/// (one shard, one partition, a one-partition topic, nothing added to the config).
#[must_use = "a world is made by .build().await"]
pub(crate) struct WorldBuilder<D> {
    name: String,
    shards: u32,
    partitions: u32,
    kafka_partitions: i32,
    config: String,
    exclusive: bool,
    grants: Option<String>,
    /// Services started once the world holds the services, before its database exists.
    first: Vec<(&'static str, &'static [(&'static str, &'static str)])>,
    source_keys: String,
    before_setup: Vec<String>,
    /// Run (blocking) with the admin URL, the prefix and the topic after `before_setup`,
    /// before `setup`.
    program_before_setup: Option<BeforeSetup>,
    database: PhantomData<D>,
}

impl World<PgDb> {
    /// A world on a fresh PostgreSQL database.
    pub(crate) fn postgres(name: &str) -> WorldBuilder<PgDb> {
        WorldBuilder::new(name)
    }
}

impl World<MyDb> {
    /// A world on a fresh MariaDB database.
    pub(crate) fn mysql(name: &str) -> WorldBuilder<MyDb> {
        WorldBuilder::new(name)
    }

    /// A new admin session on the world's database.
    pub(crate) async fn admin(&self) -> mysql_async::Conn {
        self.db.connect().await
    }
}

impl<D: Database> WorldBuilder<D> {
    /// A world on database `D`; `name` prefixes the tables and the topic.
    pub(crate) fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            shards: 1,
            partitions: 1,
            kafka_partitions: 1,
            config: String::new(),
            exclusive: false,
            grants: None,
            first: Vec::new(),
            source_keys: String::new(),
            before_setup: Vec::new(),
            program_before_setup: None,
            database: PhantomData,
        }
    }

    /// Outbox shards (tables per partition).
    pub(crate) fn shards(mut self, shards: u32) -> Self {
        self.shards = shards;
        self
    }

    /// Outbox partitions per shard.
    pub(crate) fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// Partitions of the world's Kafka topic.
    pub(crate) fn kafka_partitions(mut self, partitions: i32) -> Self {
        self.kafka_partitions = partitions;
        self
    }

    /// TOML added at the end of the config: settings of `[source.defaults]`, or whole tables
    /// of their own (`[metrics]`, `[coordination]`). Called again, it adds a line more.
    pub(crate) fn config(mut self, toml: &str) -> Self {
        if !self.config.is_empty() {
            self.config.push('\n');
        }
        self.config.push_str(toml);
        self
    }

    /// The world holds the services alone: for a test that stops or restarts one.
    pub(crate) fn exclusive(mut self) -> Self {
        self.exclusive = true;
        self
    }

    /// Starts `service` (`scripts/services up <service>`) once the world holds the services
    /// alone and before it creates its database: a replica that must see the database made.
    pub(crate) fn start_first(self, service: &'static str) -> Self {
        self.start_first_with(service, &[])
    }

    /// [`Self::start_first`] with environment variables for `scripts/services`.
    pub(crate) fn start_first_with(
        mut self,
        service: &'static str,
        vars: &'static [(&'static str, &'static str)],
    ) -> Self {
        self.exclusive = true;
        self.first.push((service, vars));
        self
    }

    /// Keys added to the `[[source]]` table (e.g. `layout = "tw-tkms"`).
    pub(crate) fn source_keys(mut self, keys: &str) -> Self {
        self.source_keys.push_str(keys);
        self.source_keys.push('\n');
        self
    }

    /// SQL run as the admin before `setup`; `{prefix}` stands for the world's table prefix.
    pub(crate) fn before_setup(mut self, sql: &str) -> Self {
        self.before_setup.push(sql.to_string());
        self
    }

    /// A program run (blocking) with the admin URL, the table prefix and the topic before
    /// `setup`, such as another outbox's writer leaving a backlog.
    pub(crate) fn program_before_setup(
        mut self,
        program: impl FnOnce(String, String, String) + Send + 'static,
    ) -> Self {
        self.program_before_setup = Some(Box::new(program));
        self
    }

    /// Creates the database, the topic and the config, and runs `setup`.
    pub(crate) async fn build(self) -> World<D> {
        let services = if self.exclusive {
            ServicesHold::Exclusive(super::exclusive_services().await)
        } else {
            ServicesHold::Shared(super::shared_services().await)
        };
        for (service, vars) in &self.first {
            super::services_with(&["up", service], vars);
        }
        let (db, streamer_url) = D::create(self.grants.as_deref()).await;
        let prefix = unique(&self.name);
        let topic = kafka::fresh_topic(&self.name, self.kafka_partitions).await;
        let dir = scratch(&prefix);
        let mut admin = db.connect().await;
        for sql in &self.before_setup {
            D::execute(&mut admin, &sql.replace("{prefix}", &prefix)).await;
        }
        if let Some(program) = self.program_before_setup {
            let (url, p, t) = (db.admin_url().to_string(), prefix.clone(), topic.clone());
            tokio::task::spawn_blocking(move || program(url, p, t)).await.expect("the program before setup");
        }
        let config = source_config_with(
            &dir,
            D::KIND,
            &streamer_url,
            &prefix,
            (self.shards, self.partitions),
            &self.source_keys.replace("{prefix}", &prefix),
            &self.config,
        );
        let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", db.admin_url()]);
        assert!(ok, "setup failed:\n{out}\n{err}");
        World {
            _services: services,
            db,
            prefix,
            topic,
            kafka_partitions: self.kafka_partitions,
            dir,
            config,
            streamer_url,
        }
    }
}

impl WorldBuilder<MyDb> {
    /// The streamer user's global privileges spelled out (for example adding `PROCESS`),
    /// instead of the documented least ones.
    pub(crate) fn grants(mut self, grants: &str) -> Self {
        self.grants = Some(grants.to_string());
        self
    }
}

impl<D: Database> World<D> {
    /// Kills `streamer` once its delete of `table`'s rows waits at the gate
    /// ([`Database::close_gate`]), and waits until the server has rolled that delete back, as
    /// a crash leaves it. `admin` ends the waiting session.
    pub(crate) async fn kill_at_the_gate(&self, streamer: Running, admin: &mut D::Conn, table: &str) {
        wait_until("the delete of the published rows to wait at the gate", ARRIVAL, || async {
            let mut c = self.db.connect().await;
            (D::waiting_at_gate(&mut c, table).await > 0).then_some(())
        })
        .await;
        streamer.kill();
        D::kill_waiting_at_gate(admin, table).await;
        wait_until("the killed instance's delete to roll back", ARRIVAL, || async {
            let mut c = self.db.connect().await;
            (D::waiting_at_gate(&mut c, table).await == 0).then_some(())
        })
        .await;
    }

    /// The outbox table of shard-partition `shard/partition`.
    pub(crate) fn table(&self, shard: u32, partition: u32) -> String {
        format!("{}_{shard}_{partition}", self.prefix)
    }

    /// Starts `outbox-streamer run` with the world's config, logging to `log` in its directory;
    /// it serves its metrics endpoint, so the test can wait on its state ([`Running::wait_for_state`]).
    pub(crate) fn start(&self, log: &str) -> Running {
        Running::start(&self.config, &self.dir.join(log))
    }

    /// Rows left in `table`.
    pub(crate) async fn count(&self, table: &str) -> i64 {
        self.db.count(table).await
    }

    /// Waits until `table` is empty.
    pub(crate) async fn wait_drained(&self, table: &str) {
        wait_until(&format!("{table} to drain"), ARRIVAL, || async { (self.db.count(table).await == 0).then_some(()) })
            .await;
    }

    /// Starts the streamer, then three times: once it streams and has published `progress`
    /// records plus a seed-dependent number more (up to 199), SIGKILLs it — at a different point
    /// of its work each time — and starts a new one. Returns the fourth, running.
    pub(crate) async fn kill_three_times(&self, progress: f64) -> Running {
        let mut streamer = self.start("run-0.log");
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for kill in 1..=3 {
            streamer.wait_for_state("streaming", ARRIVAL).await;
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let at = progress + (seed % 200) as f64;
            streamer.wait_for_metric("outbox_published_records_total", &[], at, ARRIVAL).await;
            streamer.kill();
            streamer = self.start(&format!("run-{kill}.log"));
        }
        streamer
    }

    /// Rewrites the config: `edit` gets its text and returns the new one.
    pub(crate) fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        let text = std::fs::read_to_string(&self.config).expect("reading the config");
        std::fs::write(&self.config, edit(text)).expect("writing the config");
    }
}
