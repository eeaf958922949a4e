defmodule LlamaCppEx.Server.Request do
  @moduledoc false
  # A request waiting in the server's queue.

  @enforce_keys [:tokens, :max_tokens, :opts]
  defstruct [:tokens, :max_tokens, :opts, :from, :stream_pid, :stream_ref, :monitor_ref]

  @type t :: %__MODULE__{
          tokens: [non_neg_integer()],
          max_tokens: pos_integer(),
          opts: keyword(),
          from: GenServer.from() | nil,
          stream_pid: pid() | nil,
          stream_ref: reference() | nil,
          monitor_ref: reference() | nil
        }

  @spec sync([non_neg_integer()], pos_integer(), keyword(), GenServer.from()) :: t()
  def sync(tokens, max, opts, from),
    do: struct!(__MODULE__, tokens: tokens, max_tokens: max, opts: opts, from: from)

  @spec stream([non_neg_integer()], pos_integer(), keyword(), pid(), reference()) :: t()
  def stream(tokens, max, opts, pid, ref),
    do:
      struct!(__MODULE__,
        tokens: tokens,
        max_tokens: max,
        opts: opts,
        stream_pid: pid,
        stream_ref: ref
      )

  @spec type(t()) :: :stream | :sync
  def type(%__MODULE__{stream_pid: pid}) when is_pid(pid), do: :stream
  def type(%__MODULE__{}), do: :sync

  @spec consumer_pid(t()) :: pid() | nil
  def consumer_pid(%__MODULE__{stream_pid: pid}) when is_pid(pid), do: pid
  def consumer_pid(%__MODULE__{from: {pid, _}}) when is_pid(pid), do: pid
  def consumer_pid(%__MODULE__{}), do: nil
end
