//! The sim's connection handshake in place of Ferry's noise: each end sends its peer ID and
//! reads the other's, one message each way as libp2p's plaintext exchange, but keeping no
//! read buffer for the connection's life. Encryption changes CPU, not the protocol.

use std::{io, iter};

use futures::future::BoxFuture;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::PeerId;
use libp2p::core::UpgradeInfo;
use libp2p::core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};

#[derive(Clone)]
pub struct Handshake {
    pub local: PeerId,
}

impl UpgradeInfo for Handshake {
    type Info = &'static str;
    type InfoIter = iter::Once<Self::Info>;

    fn protocol_info(&self) -> Self::InfoIter {
        iter::once("/ferry-sim/id/1")
    }
}

impl<C> InboundConnectionUpgrade<C> for Handshake
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, C);
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<(PeerId, C)>>;

    fn upgrade_inbound(self, socket: C, _: Self::Info) -> Self::Future {
        Box::pin(exchange(self.local, socket))
    }
}

impl<C> OutboundConnectionUpgrade<C> for Handshake
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, C);
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<(PeerId, C)>>;

    fn upgrade_outbound(self, socket: C, _: Self::Info) -> Self::Future {
        Box::pin(exchange(self.local, socket))
    }
}

/// One write of `[length, peer ID]`, then the other end's.
async fn exchange<C>(local: PeerId, mut socket: C) -> io::Result<(PeerId, C)>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let id = local.to_bytes();
    let mut message = vec![id.len() as u8];
    message.extend_from_slice(&id);
    socket.write_all(&message).await?;
    socket.flush().await?;
    let mut len = [0u8; 1];
    socket.read_exact(&mut len).await?;
    let mut id = vec![0u8; len[0] as usize];
    socket.read_exact(&mut id).await?;
    let remote =
        PeerId::from_bytes(&id).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((remote, socket))
}
