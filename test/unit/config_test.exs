defmodule LlamaCppEx.Server.ConfigTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.Server.Config
  alias LlamaCppEx.Test.ContractStrategies, as: C

  defmodule Policy do
    @moduledoc false
    @behaviour LlamaCppEx.Server.PausePolicy
    @impl true
    def pause_level(_info, _arg), do: :none
  end

  defp overlap?(opts) do
    path = LlamaCppEx.TestModels.smollm2_path()
    {:ok, cfg} = Config.new([model_path: path] ++ opts)
    Config.overlap?(cfg)
  end

  test "steps are queued unplanned only where a built-in strategy would plan them alike" do
    assert overlap?([])
    assert overlap?(batch_strategy: LlamaCppEx.Server.Strategy.Fair)
    refute overlap?(overlap: false)
    # a user's strategy plans every step, and a pause policy is asked before every step
    refute overlap?(batch_strategy: C.GreedyDecodeFirst)
    refute overlap?(pause_policy: Policy)
  end
end
