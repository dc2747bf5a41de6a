//! A TCP proxy in front of a RabbitMQ broker that forges acknowledgements: a broker (or something
//! between) that acknowledges a publication never sent. lapin fails the whole connection for it,
//! with an error that carries a channel's code (406).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A method of the broker's: its AMQP class and method ids.
#[derive(Clone, Copy)]
pub struct Method(pub u16, pub u16);

impl Method {
    pub const BASIC_ACK: Self = Self(60, 80);
    pub const CONFIRM_SELECT_OK: Self = Self(85, 11);
}

/// Starts a proxy to the broker of `url` (`amqp://user:password@host:port/vhost`) that, on each of
/// the first `times` connections through it, adds a `basic.ack` of a delivery tag nobody
/// published on the channel of the broker's `nth` frame of `method`, just before the broker's
/// next frame: whatever the client asked after that frame is waiting for an answer then. Returns
/// the URL to connect to through it.
pub async fn forging_acknowledgements(
    url: &str,
    method: Method,
    nth: usize,
    times: usize,
) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (credentials, rest) = rest.split_once('@').unwrap();
    let (broker, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let broker = broker.to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let [class_hi, class_lo] = method.0.to_be_bytes();
    let [method_hi, method_lo] = method.1.to_be_bytes();
    let wanted = [class_hi, class_lo, method_hi, method_lo];
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&broker).await else {
                continue;
            };
            let mut forge = connections.fetch_add(1, Ordering::SeqCst) < times;
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                let mut seen = 0;
                let mut before_next: Option<[u8; 2]> = None;
                loop {
                    // A frame: type, channel (2 bytes), size (4), payload, end octet.
                    let mut header = [0u8; 7];
                    if from_server.read_exact(&mut header).await.is_err() {
                        return;
                    }
                    let size = u32::from_be_bytes(header[3..7].try_into().unwrap()) as usize;
                    let mut frame = header.to_vec();
                    frame.resize(7 + size + 1, 0);
                    if from_server.read_exact(&mut frame[7..]).await.is_err() {
                        return;
                    }
                    if let Some([high, low]) = before_next.take() {
                        // basic.ack: delivery tag 2^40, multiple off.
                        let mut forged = vec![1, high, low, 0, 0, 0, 13, 0, 60, 0, 80];
                        forged.extend_from_slice(&(1u64 << 40).to_be_bytes());
                        forged.extend_from_slice(&[0, 0xCE]);
                        if to_client.write_all(&forged).await.is_err() {
                            return;
                        }
                    }
                    if forge && header[0] == 1 && size >= 4 && frame[7..11] == wanted {
                        seen += 1;
                        if seen == nth {
                            forge = false;
                            before_next = Some([header[1], header[2]]);
                        }
                    }
                    if to_client.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("{scheme}://{credentials}@127.0.0.1:{port}/{vhost}")
}
