defmodule LlamaCppEx.Server.Pause do
  @moduledoc false
  # The pause level in effect before each forward pass: the stronger of the one
  # `LlamaCppEx.Server.pause/2` asked for and the `:pause_policy`'s (`:none | :prefill |
  # :full`). Changes are telemetry events; time in a full pause is left out of the
  # throughput window.

  alias LlamaCppEx.Server.{PausePolicy, Slot, State, Stats}
  alias LlamaCppEx.Telemetry
  require Logger

  @doc "The level in effect now (asking the policy), recorded in the state."
  @spec update(State.t()) :: State.t()
  def update(st) do
    {policy_level, st} = policy_level(st)
    level = PausePolicy.max(st.pause_manual, policy_level)

    if level == st.pause_level do
      st
    else
      Telemetry.execute(
        [:llama_cpp_ex, :server, :pause],
        %{},
        %{server: self(), level: level, previous: st.pause_level, manual: st.pause_manual}
      )

      %{st | pause_level: level, stats: Stats.paused(st.stats, level == :full)}
    end
  end

  defp policy_level(%State{config: %{pause_policy: nil}} = st), do: {:none, st}

  defp policy_level(st) do
    {mod, arg} =
      case st.config.pause_policy do
        {mod, arg} -> {mod, arg}
        mod -> {mod, []}
      end

    info = %{
      active_slots: Enum.count(st.slots, fn {_, s} -> Slot.active?(s) end),
      queue_depth: :queue.len(st.queue),
      embed_queue_depth: LlamaCppEx.Server.Embeds.texts_waiting(st),
      tick: st.tick,
      manual: st.pause_manual
    }

    level =
      try do
        mod.pause_level(info, arg)
      catch
        kind, reason -> {:invalid, {kind, reason}}
      end

    if level in PausePolicy.levels() do
      {level, st}
    else
      unless st.policy_warned do
        Logger.warning(
          "LlamaCppEx.Server: pause policy #{inspect(mod)} returned #{inspect(level, limit: 5)}; " <>
            "running as :none (logged once per server)"
        )
      end

      {:none, %{st | policy_warned: true}}
    end
  end

  @doc """
  While paused with work waiting and a policy to ask again, the next tick comes by timer (a
  manual pause ends with `resume/1`, which ticks).
  """
  @spec poll(State.t(), (State.t() -> boolean())) :: State.t()
  def poll(%State{pause_level: :none} = st, _has_work?), do: st

  def poll(st, has_work?) do
    if st.config.pause_policy != nil and st.in_flight == nil and not st.tick_scheduled and
         has_work?.(st) do
      Process.send_after(self(), :tick, st.config.pause_poll_ms)
      %{st | tick_scheduled: true}
    else
      st
    end
  end
end
