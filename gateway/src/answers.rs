//! A remote connection's answers on their way to its writer: a queue bounded in answers and in
//! bytes, and a bell that closes the connection. The service queues without waiting (it never
//! waits on one client); the QUIC side's writer takes them off.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{mpsc, Notify};

/// The service's way to one connection's writer: a queue bounded in answers and in bytes, and
/// a bell that closes the connection.
#[derive(Clone, Debug)]
pub struct AnswerTx {
    tx: mpsc::Sender<Bytes>,
    queued: Arc<AtomicUsize>,
    max_bytes: usize,
    bell: Arc<Notify>,
    cut: Arc<AtomicBool>,
}

/// The writer's end of an [`AnswerTx`].
#[derive(Debug)]
pub struct AnswerRx {
    rx: mpsc::Receiver<Bytes>,
    queued: Arc<AtomicUsize>,
    bell: Arc<Notify>,
}

/// A connection's answer queue: at most `answers` answers and `bytes` bytes waiting.
pub fn answer_queue(answers: usize, bytes: usize) -> (AnswerTx, AnswerRx) {
    let (tx, rx) = mpsc::channel(answers.max(1));
    let queued = Arc::new(AtomicUsize::new(0));
    let bell = Arc::new(Notify::new());
    (
        AnswerTx {
            tx,
            queued: queued.clone(),
            max_bytes: bytes,
            bell: bell.clone(),
            cut: Arc::new(AtomicBool::new(false)),
        },
        AnswerRx { rx, queued, bell },
    )
}

/// Why an answer was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Unqueued {
    /// The queue is full (in answers or in bytes): the client does not read.
    Full,
    /// The connection is gone.
    Closed,
}

impl AnswerTx {
    /// Queues an answer without waiting.
    pub fn try_send(&self, bytes: Bytes) -> Result<(), Unqueued> {
        let len = bytes.len();
        // Reserved before the answer is queued, so the reader never takes off more than was
        // added and racing senders (the loop and a send's task) never pass the bound together.
        if self.queued.fetch_add(len, Ordering::Relaxed) + len > self.max_bytes {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            return Err(Unqueued::Full);
        }
        self.tx.try_send(bytes).map_err(|e| {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            match e {
                mpsc::error::TrySendError::Full(_) => Unqueued::Full,
                mpsc::error::TrySendError::Closed(_) => Unqueued::Closed,
            }
        })
    }

    /// Closes the connection: it is cut off. True the first time (whoever cuts first says
    /// so in the log; the service counts it once).
    pub fn cut(&self) -> bool {
        self.bell.notify_one();
        !self.cut.swap(true, Ordering::Relaxed)
    }

    /// Whether the connection was cut off through this queue (or a clone of it).
    pub fn was_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }
}

impl AnswerRx {
    /// The next answer, or `None` once every sender is gone.
    pub async fn recv(&mut self) -> Option<Bytes> {
        let bytes = self.rx.recv().await?;
        self.queued.fetch_sub(bytes.len(), Ordering::Relaxed);
        Some(bytes)
    }
}

impl AnswerRx {
    /// The bell the service rings to close the connection.
    pub fn bell(&self) -> Arc<Notify> {
        self.bell.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn answer(len: usize) -> Bytes {
        Bytes::from(vec![0u8; len])
    }

    #[tokio::test]
    async fn the_answer_queue_is_bounded_in_answers_and_in_bytes() {
        // In bytes: 10 + 10 fit in 25, a third does not; taking one makes room again.
        let (tx, mut rx) = answer_queue(8, 25);
        assert_eq!(tx.try_send(answer(10)), Ok(()));
        assert_eq!(tx.try_send(answer(10)), Ok(()));
        assert_eq!(tx.try_send(answer(10)), Err(Unqueued::Full));
        assert_eq!(rx.recv().await.map(|b| b.len()), Some(10));
        assert_eq!(tx.try_send(answer(10)), Ok(()));
        // A refused answer leaves no count behind: 5 more still fit exactly.
        assert_eq!(tx.try_send(answer(6)), Err(Unqueued::Full));
        assert_eq!(tx.try_send(answer(5)), Ok(()));

        // In answers: two small ones fill a queue of two.
        let (tx, mut rx) = answer_queue(2, 1_000);
        assert_eq!(tx.try_send(answer(1)), Ok(()));
        assert_eq!(tx.try_send(answer(1)), Ok(()));
        assert_eq!(tx.try_send(answer(1)), Err(Unqueued::Full));
        // A refusal for want of a slot gives its bytes back.
        assert_eq!(tx.queued.load(Ordering::Relaxed), 2);
        rx.recv().await;
        assert_eq!(tx.try_send(answer(1)), Ok(()));

        // A connection gone is not a full queue (the client is not cut off for it).
        drop(rx);
        assert_eq!(tx.try_send(answer(1)), Err(Unqueued::Closed));
    }

    #[tokio::test]
    async fn cutting_rings_the_writers_bell_even_before_it_waits() {
        let (tx, rx) = answer_queue(1, 1);
        tx.cut();
        tokio::time::timeout(Duration::from_secs(5), rx.bell.notified())
            .await
            .expect("the bell rang");
    }
}
