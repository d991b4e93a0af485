//! After a catch-up: rows its drain sent that the stream reads again from the new position.
//!
//! A transaction that commits after the catch-up took its new position (a), while it waits
//! for the table's writers or drains (b), is in the log the stream reads next (c) **and** can
//! be in the table the drain reads. The drain sends it and deletes its rows; the stream then
//! reads it again. The source reports the highest id the drain covered
//! ([`Source::drained_upto`], stored with the end of the catch-up): until the stream has read
//! past the log's end as it was when this session began (every transaction the drain could
//! have seen committed before that), a row at or below that id is looked up — once its
//! transaction is visible to queries — and one that is gone from the table is not sent again:
//! only this stream deletes rows it has not sent, after sending them.
//!
//! A row above the id, or of a transaction past that end, was never the drain's. The check
//! costs one query per row in that window, none after it.

use super::Session;
use crate::error::Error;
use crate::sink::Sink;
use crate::source::Source;

/// The window in which a row can be one the last catch-up's drain sent.
#[derive(Debug)]
pub(super) struct Overlap<P> {
    /// The highest id the drain covered.
    upto: i64,
    /// The log's end when the session began: past it, nothing was the drain's.
    until: P,
    /// Rows found sent by the drain, for the log line at the end of the window.
    skipped: u64,
}

/// The session's window, when the source reports a catch-up's drain (one probe of the log's
/// end).
pub(super) async fn start<S: Source>(source: &mut S) -> Result<Option<Overlap<S::Position>>, Error> {
    let Some(upto) = source.drained_upto() else { return Ok(None) };
    let probe = source.probe(None, 0).await?;
    Ok(Some(Overlap { upto, until: probe.mark, skipped: 0 }))
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// A transaction begins: the window closes once the stream has read past its end.
    pub(super) fn overlap_begin<S: Source<Position = P>>(&mut self) {
        let Some(overlap) = &self.overlap else { return };
        if self.last_position.as_ref().is_some_and(|read| S::reached(read, &overlap.until)) {
            if overlap.skipped > 0 {
                tracing::info!(
                    rows = overlap.skipped,
                    "rows of transactions that committed during the last catch-up were sent by its drain; they were not sent again"
                );
            }
            self.overlap = None;
        }
    }

    /// Whether the row `id` of the transaction being read is one the last catch-up's drain
    /// sent (in the window, at or below its id, gone from the table). `table_row`: the row is
    /// a table row (a WAL-only message never was the drain's).
    pub(super) async fn sent_by_drain<S: Source<Position = P>>(
        &mut self,
        source: &mut S,
        id: Option<i64>,
        table_row: bool,
    ) -> Result<bool, Error> {
        let Some(overlap) = &self.overlap else { return Ok(false) };
        let Some(id) = id.filter(|id| table_row && *id <= overlap.upto) else { return Ok(false) };
        if !source.current_rows(&[id]).await?.is_empty() {
            return Ok(false);
        }
        if let Some(overlap) = &mut self.overlap {
            overlap.skipped += 1;
        }
        self.hot.replayed.increment(1);
        Ok(true)
    }
}
