//! The peer process of `kvshm bench ring`: answers commands from the rings, then echoes pipe
//! messages.
//!
//! 1. attach to the driver's object, consume the command ring and answer:
//!    - a round-trip command (busy, futex or sleep phase) with one completion carrying the CPU the
//!      peer answers from and its futex sleeps so far; the phase also says how to wait for the
//!      next command (spin without end, spin then sleep, or sleep at once);
//!    - stream records with nothing, checking their sequence, and waiting for more the way a
//!      worker would (spin briefly, then sleep); the stream's end with one completion carrying the
//!      count;
//! 2. on the exit command, echo 64-byte messages from stdin as 32-byte answers (carrying the CPU
//!    too) on stdout until stdin closes: the pipe round trip the rings are compared with.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;

use anyhow::{bail, ensure, Context};
use kvshm_ipc::doorbell::{futex_sleeps, WaitOutcome};
use kvshm_ipc::record::{CommandSlot, Completion};

use super::channel::{
    Channel, COMMAND_CAPACITY, PHASE_BUSY, PHASE_EXIT, PHASE_FUTEX, PHASE_SLEEP, PHASE_STREAM,
    PHASE_STREAM_END,
};
use super::{busy_policy, current_cpu, futex_policy, phase_policy, PEER_PATIENCE};

pub fn run(object: &str) -> anyhow::Result<()> {
    answer_ring_commands(object)?;
    echo_pipe_messages()
}

fn answer_ring_commands(object: &str) -> anyhow::Result<()> {
    let channel = Channel::open(object)?;
    let mut commands = channel.command_consumer()?;
    let mut completions = channel.completion_producer()?;
    let mut policy = busy_policy();
    let mut slots = Vec::with_capacity(COMMAND_CAPACITY);
    let mut answers = Vec::new();
    let mut stream_seen = 0u64;
    loop {
        let outcome = channel
            .commands_bell()
            .wait_until(|| !commands.is_empty().unwrap_or(true), policy.within(PEER_PATIENCE));
        if outcome == WaitOutcome::TimedOut {
            bail!("the benchmark driver sent nothing for {PEER_PATIENCE:?}");
        }
        slots.clear();
        commands.pop_into(&mut slots, COMMAND_CAPACITY).context("reading the command ring")?;
        answers.clear();
        for slot in &slots {
            let header = slot.header();
            match header.generation {
                PHASE_BUSY | PHASE_FUTEX | PHASE_SLEEP => {
                    policy = phase_policy(header.generation);
                    answers.push(answer(header.command_id, header.generation));
                }
                PHASE_STREAM => {
                    ensure!(
                        header.command_id == stream_seen,
                        "stream record {} arrived where {stream_seen} was expected",
                        header.command_id
                    );
                    stream_seen += 1;
                    policy = futex_policy();
                }
                PHASE_STREAM_END => {
                    let mut answer = Completion::ok(header.command_id, header.generation);
                    answer.detail = stream_seen;
                    answers.push(answer);
                    stream_seen = 0;
                }
                PHASE_EXIT => return Ok(()),
                phase => bail!("unknown benchmark phase {phase}"),
            }
        }
        if !answers.is_empty() {
            completions
                .push_all(&answers)
                .map_err(|_| anyhow::anyhow!("the driver let the completion ring overflow"))?;
            channel.completions_bell().ring();
        }
    }
}

fn echo_pipe_messages() -> anyhow::Result<()> {
    // Unbuffered duplicates of stdin and stdout: one system call per message, as a program using
    // a pipe for this would do.
    let mut input = File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
    let mut output = File::from(std::io::stdout().as_fd().try_clone_to_owned()?);
    let mut message = CommandSlot::default();
    loop {
        match input.read_exact(bytemuck::bytes_of_mut(&mut message)) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(error) => return Err(error).context("reading a pipe message"),
        }
        let header = message.header();
        let answer = answer(header.command_id, header.generation);
        output.write_all(bytemuck::bytes_of(&answer)).context("writing a pipe answer")?;
    }
}

/// A round-trip answer: the CPU this process answers from in `error`, its futex sleeps so far in
/// `detail` (the benchmark's own use of the fields of an OK completion).
fn answer(command_id: u64, phase: u64) -> Completion {
    let mut answer = Completion::ok(command_id, phase);
    answer.error = current_cpu().unwrap_or(u32::MAX);
    answer.detail = futex_sleeps();
    answer
}
