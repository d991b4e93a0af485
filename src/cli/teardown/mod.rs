//! `outbox-streamer teardown`: removes what `setup` created for every source of the config —
//! tables, publications, slots, checkpoint rows and table, the enqueue function, the grants it
//! gave — and the cluster's ZooKeeper nodes. A dry run unless `--yes`.
//!
//! It says, object by object, what it drops and what it leaves and why ([`crate::db::teardown`]
//! holds the rules; each database's folder does the dropping). Running it again finds nothing
//! and says so. Exit code 0 when nothing is left (in a dry run: when nothing would be), 1
//! otherwise.

mod zookeeper;

use std::process::ExitCode;

use clap::Args;

use super::admin::AdminArgs;
use crate::config::Config;
use crate::db::teardown::{Line, Object, Options, Section};
use crate::db::{self, TeardownRequest};

/// `outbox-streamer teardown` flags.
#[derive(Debug, Clone, Args)]
pub struct TeardownArgs {
    /// Act. Without it, teardown only says what it would drop and what it would leave.
    #[arg(long)]
    pub yes: bool,
    /// Also drop tables that still hold rows: those messages are never sent (teardown says how
    /// many). Without it such a table stays, with its shard-partition's other objects.
    #[arg(long)]
    pub drop_pending: bool,
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// How a section is shown; what it holds is decided in [`crate::db::teardown`].
impl Section {
    fn print(&self, options: Options) {
        println!("{}:", self.title);
        if self.count(false) + self.count(true) == 0 {
            println!("  nothing to tear down");
        }
        let (drop, leave) = if options.act { ("dropped", "left") } else { ("would drop", "would leave") };
        let list = |objects: &[Object]| objects.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        for line in &self.lines {
            match line {
                // What vanished between looking and dropping: nothing to say.
                Line::Drop(objects) if objects.is_empty() => {}
                Line::Drop(objects) => println!("  {drop} {}", list(objects)),
                Line::Leave(objects, why) => println!("  {leave} {}: {why}", list(objects)),
                Line::Note(note) => println!("  note: {note}"),
            }
        }
        let discarded: i64 = self
            .lines
            .iter()
            .filter_map(|l| match l {
                Line::Drop(objects) => Some(objects),
                _ => None,
            })
            .flatten()
            .filter_map(|o| match o {
                Object::Table { rows: Some(rows), .. } => Some(*rows),
                _ => None,
            })
            .sum();
        if discarded > 0 {
            let verb = if options.act { "discarded" } else { "would discard" };
            println!("  --drop-pending {verb} {discarded} row(s) that were never published");
        }
    }

    /// How many groups were (or would be) left, or dropped.
    fn count(&self, leave: bool) -> usize {
        self.lines
            .iter()
            .filter(|l| match l {
                Line::Drop(objects) => !leave && !objects.is_empty(),
                Line::Leave(..) => leave,
                Line::Note(_) => false,
            })
            .count()
    }
}

/// Runs teardown for every source, then for the cluster's ZooKeeper nodes.
pub(super) async fn teardown(config: &Config, args: TeardownArgs) -> anyhow::Result<ExitCode> {
    let admin = args.admin.resolve()?;
    let options = Options { act: args.yes, drop_pending: args.drop_pending };
    // Read first: which instances run, and which shard-partitions they serve.
    let cluster = match &config.coordination {
        Some(c) => Some(zookeeper::Cluster::open(c).await),
        None => None,
    };
    let members = cluster.as_ref().and_then(|c| c.as_ref().ok());
    let (mut dropped, mut left, mut failed) = (0, 0, false);
    for source in &config.sources {
        let how = TeardownRequest {
            admin: admin.login(),
            options,
            members: members.map(|c| c as &dyn db::teardown::Members),
        };
        if !source.layout().owns_tables() {
            // Its tables are the application's; dropping them would lose its messages.
            println!(
                "source {:?}:\n  error: layout = \"{}\": its tables belong to the application and teardown never drops them; drop the publications, slots and {}_checkpoint by hand (docs/drop-in.md)",
                source.name,
                source.layout().as_str(),
                source.table_prefix
            );
            failed = true;
            continue;
        }
        let section = db::of(source.kind).teardown(source, &how).await;
        match section {
            Ok(section) => {
                section.print(options);
                dropped += section.count(false);
                left += section.count(true);
            }
            Err(e) => {
                println!("source {:?}:\n  error: {e:#}", source.name);
                failed = true;
            }
        }
    }
    if let (Some(cluster), Some(c)) = (cluster, &config.coordination) {
        let section = zookeeper::tear_down(c, cluster, options).await;
        section.print(options);
        dropped += section.count(false);
        left += section.count(true);
    }
    println!();
    match (options.act, dropped, left, failed) {
        (_, _, _, true) => {
            println!("not every source could be read (see the errors above); fix that and run teardown again")
        }
        (_, 0, 0, false) => println!("nothing to tear down: nothing that setup creates is left"),
        (false, _, _, false) => println!("dry run: nothing was changed; run again with --yes to do the above"),
        (true, _, 0, false) => println!("teardown complete: nothing that setup creates is left"),
        (true, _, _, false) => {
            println!("not everything was removed (see above); run teardown again once that is resolved")
        }
    }
    Ok(if left > 0 || failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
