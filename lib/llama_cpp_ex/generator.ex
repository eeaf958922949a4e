defmodule LlamaCppEx.Generator do
  @moduledoc false
  # Runs a native generator in a linked process that sends `{ref, msg}` messages to the
  # caller, with a cancel flag the caller can raise to stop it within one token.

  alias LlamaCppEx.NIF

  @type t :: %{ref: reference(), pid: pid(), cancel: reference()}

  @spec start(({pid(), reference(), reference()} -> any())) :: {:ok, t()}
  def start(fun) do
    caller = self()
    ref = make_ref()
    cancel = NIF.cancel_flag_new()
    pid = spawn_link(fn -> fun.({caller, ref, cancel}) end)
    {:ok, %{ref: ref, pid: pid, cancel: cancel}}
  end

  @spec stop(t()) :: :ok
  def stop(%{ref: ref, pid: pid, cancel: cancel}) do
    NIF.request_cancel(cancel)
    Process.unlink(pid)
    Process.exit(pid, :kill)

    receive do
      {:EXIT, ^pid, _} -> :ok
    after
      0 -> :ok
    end

    drain(ref)
  end

  @spec drain(reference()) :: :ok
  def drain(ref) do
    receive do
      {^ref, _} -> drain(ref)
    after
      0 -> :ok
    end
  end
end
