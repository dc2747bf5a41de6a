//! Publishing with publisher confirms where a returned message is the publication's own: each
//! channel carries at most one publication awaiting its confirmation.
//!
//! A `mandatory` publication that no queue takes comes back as `basic.return`, followed by its
//! `basic.ack`. lapin hands a returned message to the confirmation it resolves next on the
//! channel, and RabbitMQ confirms several publications of a channel with one `basic.ack`
//! (`multiple`): with more than one publication unconfirmed on a channel, the return can reach
//! another publication's confirmation, so that the unroutable message reads as confirmed (and is
//! lost) and a routed one as returned. With one publication unconfirmed per channel there is no
//! other confirmation for it to reach. [`ConfirmChannels`] keeps such channels: as many as are
//! publishing at once, up to [`MAX_CHANNELS`], taken and given back per publication. A
//! publication given up on (its timeout) is still unconfirmed on its channel: a channel of the
//! connection is then closed, and the only channel of a runner made from one is lent again once
//! the broker has confirmed what it carries.

use std::sync::{Arc, Mutex};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most channels publishing at once on one connection; a publication beyond waits for one.
pub(super) const MAX_CHANNELS: usize = 256;

/// Channels in publisher-confirm mode, each lent to one publication at a time.
pub(super) struct ConfirmChannels {
    source: Source,
    idle: Mutex<Vec<Channel>>,
    permits: Arc<Semaphore>,
}

enum Source {
    /// Opens channels on this connection, as many as are needed.
    Connection(Arc<Connection>),
    /// Has only this channel (already in confirm mode), lent to one publication at a time.
    Channel,
}

/// A channel lent to one publication: given back when its confirmation came. When it did not (the
/// publication was given up on), a publication still unconfirmed on it could be confirmed with
/// another's: a channel of the connection is closed, and the only channel is given back once the
/// broker has confirmed what it carries.
pub(super) struct Lent {
    channel: Option<Channel>,
    channels: Arc<ConfirmChannels>,
    confirmed: bool,
    permit: Option<OwnedSemaphorePermit>,
}

impl ConfirmChannels {
    /// Returns channels opened on `connection` when they are needed.
    pub(super) fn on(connection: Arc<Connection>) -> Arc<Self> {
        Arc::new(Self {
            source: Source::Connection(connection),
            idle: Mutex::default(),
            permits: Arc::new(Semaphore::new(MAX_CHANNELS)),
        })
    }

    /// Returns `channel` (in publisher-confirm mode) lent to one publication at a time.
    pub(super) fn only(channel: Channel) -> Arc<Self> {
        Arc::new(Self {
            source: Source::Channel,
            idle: Mutex::new(vec![channel]),
            permits: Arc::new(Semaphore::new(1)),
        })
    }

    /// Returns the connection the channels are opened on, if they are.
    pub(super) fn connection(&self) -> Option<&Arc<Connection>> {
        match &self.source {
            Source::Connection(connection) => Some(connection),
            Source::Channel => None,
        }
    }

    /// Returns whether publications can go out: the connection is open (a single channel's
    /// trouble is met by the publication itself).
    pub(super) fn connected(&self) -> bool {
        match &self.source {
            Source::Connection(connection) => connection.status().connected(),
            Source::Channel => true,
        }
    }

    /// Closes the channels of the connection not lent: the next publications open new ones. (The
    /// only channel stays.)
    pub(super) fn close_idle(&self) {
        if !matches!(self.source, Source::Connection(_)) {
            return;
        }
        let idle = std::mem::take(&mut *self.idle());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for channel in idle {
                    let _ = channel.close(200, "".into()).await;
                }
            });
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Channel>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lends a channel with no publication awaiting confirmation: an idle one, or a new one;
    /// waits while [`MAX_CHANNELS`] are lent.
    pub(super) async fn lend(self: &Arc<Self>) -> lapin::Result<Lent> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let idle = {
            let mut idle = self.idle();
            match self.source {
                // The only channel stays, open or not: its trouble is the publication's to meet.
                Source::Channel => idle.pop(),
                Source::Connection(_) => {
                    idle.retain(|channel| channel.status().connected());
                    idle.pop()
                }
            }
        };
        let channel = match (idle, &self.source) {
            (Some(channel), _) => channel,
            (None, Source::Connection(connection)) => {
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                channel
            }
            (None, Source::Channel) => unreachable!("the only channel is lent to one at a time"),
        };
        Ok(Lent {
            channel: Some(channel),
            channels: self.clone(),
            confirmed: false,
            permit: Some(permit),
        })
    }
}

impl Lent {
    /// Publishes `payload` to `exchange` with `routing_key`, `mandatory` (an unroutable message is
    /// returned), and waits for the broker's confirmation; the returned message in it, if any, is
    /// this publication's.
    pub(super) async fn publish(
        mut self,
        exchange: ShortString,
        routing_key: ShortString,
        payload: &[u8],
        properties: BasicProperties,
    ) -> lapin::Result<Confirmation> {
        let channel = self.channel.as_ref().expect("lent until dropped");
        let confirmation = channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                payload,
                properties,
            )
            .await?
            .await?;
        self.confirmed = true;
        Ok(confirmation)
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else {
            return;
        };
        if self.confirmed {
            // Nothing unconfirmed on it.
            self.channels.idle().push(channel);
            return;
        }
        match (&self.channels.source, tokio::runtime::Handle::try_current()) {
            // It is closed, not lent again.
            (Source::Connection(_), Ok(runtime)) => {
                runtime.spawn(async move {
                    let _ = channel.close(200, "".into()).await;
                });
            }
            (Source::Connection(_), Err(_)) => {}
            // Lent again (the permit held until then) once the broker confirmed what it carries,
            // or the channel failed: its trouble is the next publication's to meet.
            (Source::Channel, Ok(runtime)) => {
                let channels = self.channels.clone();
                let permit = self.permit.take();
                runtime.spawn(async move {
                    let _ = channel.wait_for_confirms().await;
                    channels.idle().push(channel);
                    drop(permit);
                });
            }
            // No runtime left to wait on, nor to publish with: it is only kept.
            (Source::Channel, Err(_)) => self.channels.idle().push(channel),
        }
    }
}
