//! MySQL/MariaDB errors that retrying cannot fix halt once with the server's message and the
//! fix, instead of resending the pending rows with every retry.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::kafka;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);
/// Long enough for a retry loop to show itself; a halted stream is long settled by then.
const HALT: Duration = Duration::from_secs(60);

/// Item 7: a streamer user without DELETE. Each row is published once and the cleanup's
/// error 1142 halts the shard-partition once with the GRANT to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_delete_grant_halts_once_without_republishing() {
    let w = World::mysql("mnd").build().await;
    let table = w.table(0, 0);
    let user =
        w.streamer_url.strip_prefix("mysql://").and_then(|u| u.split(':').next()).expect("mysql://user:…").to_string();
    let mut admin = w.admin().await;
    admin.query_drop(format!("REVOKE DELETE ON {}.{table} FROM '{user}'@'127.0.0.1'", w.db.name)).await.unwrap();
    for i in 0..5 {
        admin
            .exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)"), (&w.topic, format!("p{i}")))
            .await
            .unwrap();
    }
    let streamer = w.start("no-delete.log");
    let error = streamer.wait_for_one_halt(HALT).await;
    assert!(error.contains("DELETE command denied") && error.contains("(error 1142)"), "{error}");
    let grant = format!("GRANT SELECT, DELETE ON `{}`.`{table}` TO '{user}'@'<host>'", w.db.name);
    assert!(error.contains(&grant), "the fix names the GRANT: {error}");
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(records.len(), 5, "each row published once, not once per retry");
    assert_eq!(w.count(&w.table(0, 0)).await, 5, "nothing deleted, so nothing is lost");
    assert!(streamer.stop());
    admin.disconnect().await.unwrap();
}
