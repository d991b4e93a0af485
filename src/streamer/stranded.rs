//! Rows the log never carried (a statement-logged session, `sql_log_bin=0`, rows written
//! before the slot existed): the sweep finds them in the table and they are published as one
//! more transaction at the stream's current position.

use metrics::counter;

use super::Session;
use crate::error::Error;
use crate::metrics as m;
use crate::sink::Sink;
use crate::source::Source;
use crate::sweep::Step;

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// One step of the sweep (see [`crate::sweep`]); runs between transactions.
    pub(super) async fn sweep<S: Source<Position = P>>(&mut self, source: &mut S) -> Result<(), Error> {
        match self.sweep.step(self.done.as_ref(), S::reached) {
            Step::Wait => Ok(()),
            Step::Probe { below } => {
                let probe = source.probe(below, crate::sweep::CANDIDATE_LIMIT).await?;
                self.sweep.probed(probe);
                Ok(())
            }
            Step::Check(candidates) => {
                let stranded = source.existing(&candidates).await?;
                self.sweep.checked();
                if stranded.is_empty() {
                    return Ok(());
                }
                self.publish_stranded(source, stranded).await
            }
        }
    }

    /// Publishes rows the log never carried as one more transaction at the stream's current
    /// position (the last transaction read, or the idle position confirmed), so their delete
    /// is stored like any other.
    async fn publish_stranded<S: Source<Position = P>>(&mut self, source: &mut S, ids: Vec<i64>) -> Result<(), Error> {
        let Some(position) = self.last_position.clone().or_else(|| self.done.clone()) else { return Ok(()) };
        let rows = source.current_rows(&ids).await?;
        if rows.is_empty() {
            return Ok(());
        }
        let first: Vec<i64> = ids.iter().take(10).copied().collect();
        tracing::warn!(
            rows = rows.len(),
            first_ids = ?first,
            "rows stayed in the table after the stream passed every commit that could hold them (a statement-logged session, sql_log_bin=0, rows written before the slot existed); publishing them now, after rows committed later"
        );
        counter!(m::SWEPT_ROWS, &self.metric_labels).increment(rows.len() as u64);
        let seq = self.tracker.begin();
        self.open = Some(seq);
        self.label = position.to_string();
        for row in rows {
            let id = match &row {
                Ok(record) => Some(record.id),
                Err(invalid) => invalid.id,
            };
            if let (Some(id), Some(eo)) = (id, &mut self.eo)
                && eo.in_kafka(id)
            {
                // A committed Kafka transaction of the last session holds it (exactly-once).
                self.tracker.sent(seq, Some(id));
                self.tracker.acked(seq);
                self.hot.replayed.increment(1);
                continue;
            }
            match row {
                Ok(record) => self.publish(seq, record).await?,
                Err(invalid) => self.on_invalid_row(source, seq, invalid).await?,
            }
        }
        self.open = None;
        self.tracker.commit(seq, position);
        Ok(())
    }
}
